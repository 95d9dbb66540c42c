"""Timing primitives of the GPU benchmarks (bench, bench_quant, bench_codec) and the benchmark's log line."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def device_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median device time of one call of `fn` (seconds): CUDA events around each of `reps` calls."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return float(np.median(times))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], iters: int, device: torch.device, warmup: int = 2) -> float:
    """Seconds per call: wall clock over `iters` back-to-back calls, the device drained at both ends."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def report(text: str, out: str | None) -> None:
    """Print `text`, and write it to `out` when given (the profiling scripts' tables)."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


def kernel_time(prof: Any) -> tuple[int, float]:
    """(kernels, ms of device time) a finished torch.profiler run recorded on CUDA (graph replays'
    kernels included)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), sum(e.device_time for e in kernels) / 1e3
