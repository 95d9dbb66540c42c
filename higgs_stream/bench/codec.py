"""The codec section: the full-size codec's decode time per shape as the pipeline calls it, and the
settings the pipeline does not use (cuDNN autotuning, TF32) at one steady-state shape."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from higgs_stream.bench.measure import timed


@torch.inference_mode()
def codec_timings(codec: Any, shapes: list[tuple[int, int]]) -> list[dict]:
    """Codec decode wall time (GPU, fp32, incl. the copy back) per [B, 8, F] shape: first call and warm."""
    out = []
    for b, f in shapes:
        codes = torch.randint(0, 1024, (b, 8, f))
        t0 = time.perf_counter()
        codec.decode(codes).cpu()
        first = time.perf_counter() - t0
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            codec.decode(codes).cpu()
            times.append(time.perf_counter() - t0)
        out.append({"batch": b, "frames": f, "first_ms": first * 1e3, "warm_ms": float(np.median(times)) * 1e3})
    return out


@torch.inference_mode()
def codec_variants(codec: Any, shape: tuple[int, int] = (32, 48)) -> dict:
    """Codec decode ms at one steady-state shape: as served (fp32, cuDNN heuristics), with cuDNN
    autotuning (still fp32), and with TF32 (not exact); max |d| of each against the served one."""
    b, f = shape
    codes = torch.randint(0, 1024, (b, 8, f), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {"batch": b, "frames": f}

    def decode_ms() -> tuple[float, torch.Tensor]:
        ref = codec.decode(codes)
        return timed(lambda: codec.decode(codes), 5, torch.device("cuda"), warmup=1) * 1e3, ref

    out["fp32_ms"], base = decode_ms()
    bench_flag = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = True
        out["fp32_autotuned_ms"], y = decode_ms()
        out["fp32_autotuned_max_abs_diff"] = float((y - base).abs().max())
    finally:
        torch.backends.cudnn.benchmark = bench_flag
    try:
        codec.allow_tf32 = True
        out["tf32_ms"], y = decode_ms()
        out["tf32_max_abs_diff"] = float((y - base).abs().max())
    finally:
        codec.allow_tf32 = False
    out["peak_abs"] = float(base.abs().max())
    return out
