"""Plain (bf16 / fp16) linears of the fast path on the CUDA-core GEMV where it beats cuBLAS on this device.

At a few rows a linear is a weight read, and cuBLAS's heuristics pick poorly for some of those shapes. H200, torch
2.11 (cuBLAS 13), session 25 (`scripts/sweep_gemv.py --weights bf16 --linears qwen3-1.7b`, each call reading its
weight from HBM): Qwen3-TTS's code-predictor o projection and its input projection (N 1024, K 2048) take 12.9 us at
1-2 rows and 8.5 at 4, where the GEMV (kernels/int8_linear.py `triton_gemv`, fp32 sums on CUDA cores) takes 5.6 / 4.3
/ 5.3; the predictor runs the o projection 75 times a frame. At most other shapes the two are within 10 %, and at 4
rows cuBLAS mostly wins. Which shapes lose is a property of cuBLAS's version and of the card, so it is measured here,
not listed: `measure` times both ways for each distinct weight shape (N, K) at each row count 1..max_rows (a CUDA
graph of calls cycling over enough copies of the weight to exceed the L2, so each call reads its weight from memory as
a decode step does), and the GEMV serves a shape, at every row count up to max_rows, where its times summed over those
row counts are at most MARGIN of cuBLAS's: a near-tie keeps cuBLAS, so the choice does not flip from one start to the
next. The GEMV compiles once per K and row count: ~12 s at load, one compile after another, on a machine whose Triton
cache is cold (H200, v2 or Qwen3-TTS 1.7B), under a second once the cache holds them; `compile_ahead` runs those
compiles side by side in threads before the timing (H200, 16 CPUs, empty caches: the choice for the 1.7B's shapes in
3.3 s instead of 8.2, for v2's in 2.9 instead of 4.9; scripts/cold_start_gemv.py).

Numerics: both accumulate in fp32 and round once to the weight's dtype; the sums' order differs, so a row's result
can differ in the last bit between the two ways. The GEMV's rows are separate reductions in one order whatever the
row count, and a shape it serves it serves at every count up to max_rows: a row's result is the same in any batch of
1..max_rows rows; above them cuBLAS serves every shape (whose kernel, and so its sums, may change with the row count).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from higgs_stream.kernels.int8_linear import GEMV_ROWS_MAX, compile_plain_gemv, plain_gemv_blocks, triton_gemv

log = logging.getLogger(__name__)

MARGIN = 0.85  # the GEMV serves a shape whose summed time was at most this share of cuBLAS's
PLAIN_DTYPES = (torch.bfloat16, torch.float16)
Shape = tuple[int, int]  # (N, K)
Timer = Callable[[Shape, int, str], float]  # (shape, rows, "cublas" | "gemv") -> microseconds a call


@dataclass(frozen=True)
class GemvChoice:
    """Which weight shapes run on the GEMV at 1..max_rows rows; every other plain linear on cuBLAS (`F.linear`)."""

    shapes: frozenset[Shape] = frozenset()
    max_rows: int = 0
    # what `measure` timed: {"n", "k", "m", "cublas_us", "gemv_us"}, or {"n", "k", "error"} for a shape that failed
    timings: tuple[dict, ...] = ()

    def describe(self) -> dict:
        """The choice as JSON: the rows the GEMV serves and the shapes [N, K] it took (`/healthz`, the bench)."""
        return {"bf16_gemv_rows": self.max_rows, "gemv_shapes": [list(x) for x in sorted(self.shapes)]}

    def report(self) -> list[str]:
        """One line per shape on the GEMV, with its times at 1..max_rows rows (the start-up log, the bench)."""
        lines = []
        for n, k in sorted(self.shapes):
            us = ", ".join(f"{r['cublas_us']:.1f} -> {r['gemv_us']:.1f}" for r in self.timings
                           if (r["n"], r["k"]) == (n, k))  # a chosen shape has no error
            lines.append(f"plain linear [{n}, {k}] on the CUDA-core GEMV at 1-{self.max_rows} rows "
                         f"(us, cuBLAS -> GEMV: {us})")
        return lines

    def serves(self, w: torch.Tensor, m: int) -> bool:
        return 1 <= m <= self.max_rows and (w.shape[0], w.shape[1]) in self.shapes

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ w^T (+ bias) -> [..., N] in x's dtype: the GEMV where chosen (a choice is measured on CUDA
        only; the GEMV reads a contiguous bf16 / fp16 weight), else F.linear."""
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        plain = x.dtype == w.dtype and w.dtype in PLAIN_DTYPES and w.is_contiguous()
        if plain and self.serves(w, x2.shape[0]):
            return triton_gemv(x2.contiguous(), w, None, plain_gemv_blocks(k), bias).view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, bias)


NONE = GemvChoice()  # cuBLAS everywhere


def plain_shapes(weights: Iterable[object]) -> list[Shape]:
    """The distinct (N, K) of the plain 2-D bf16 / fp16 tensors among `weights` (quantized ones skipped)."""
    out: list[Shape] = []
    for w in weights:
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in PLAIN_DTYPES:
            shape = (w.shape[0], w.shape[1])
            if shape not in out:
                out.append(shape)
    return out


def choose(shapes: Iterable[Shape], max_rows: int, timer: Timer) -> GemvChoice:
    """Time both ways for each shape at 1..max_rows rows; the GEMV for the shapes whose summed time was at most
    MARGIN of cuBLAS's. A shape whose timing fails (out of memory for the weight's copies, a kernel that does not
    compile on this device) stays on cuBLAS, with the error logged and kept in `timings`: an optimisation never
    stops a start-up."""
    assert 0 <= max_rows <= GEMV_ROWS_MAX, f"max_rows must be in 0..{GEMV_ROWS_MAX}, got {max_rows}"
    won, timings = set(), []
    for n, k in shapes:
        try:
            rows = [{"n": n, "k": k, "m": m, "cublas_us": timer((n, k), m, "cublas"),
                     "gemv_us": timer((n, k), m, "gemv")} for m in range(1, max_rows + 1)]
        except Exception as exc:  # noqa: BLE001 - any failure keeps this shape on cuBLAS
            log.warning("timing the CUDA-core GEMV for [%d, %d] failed (%r): cuBLAS serves it", n, k, exc)
            timings.append({"n": n, "k": k, "error": repr(exc)[:200]})
            continue
        timings += rows
        if rows and sum(r["gemv_us"] for r in rows) <= MARGIN * sum(r["cublas_us"] for r in rows):
            won.add((n, k))
    return GemvChoice(frozenset(won), max_rows, tuple(timings))


def measure(weights: Iterable[object], max_rows: int, dtype: torch.dtype, device: torch.device) -> GemvChoice:
    """`choose` over the plain weights' shapes, timed on `device` (NONE when there are none or max_rows is 0)."""
    shapes = plain_shapes(weights)
    if not shapes or max_rows == 0:
        return NONE
    with torch.cuda.device(device):
        compile_ahead(shapes, max_rows, dtype)
        choice = choose(shapes, max_rows, DeviceTimer(dtype, device))
    for line in choice.report():
        log.info("%s", line)
    return choice


def compile_ahead(shapes: list[Shape], max_rows: int, dtype: torch.dtype,
                  compile_fn: Callable[[list[tuple[int, int, int]], torch.dtype], None] = compile_plain_gemv) -> None:
    """Compile the GEMV variants the timing will launch ((rows, N, K) for each shape and 1..max_rows rows) side by
    side before it (kernels/int8_linear.py `compile_plain_gemv`). A failure only costs time: it is logged, and each
    timing then compiles its own variant (and `choose` keeps a shape that fails there on cuBLAS)."""
    cases = [(m, n, k) for n, k in shapes for m in range(1, max_rows + 1)]
    start = time.perf_counter()
    try:
        compile_fn(cases, dtype)
    except Exception as exc:  # noqa: BLE001 - an optimisation of the start-up never stops it
        log.warning("compiling the CUDA-core GEMV ahead failed (%r): the timing compiles it as it goes", exc)
        return
    log.info("compiled the CUDA-core GEMV for %d (rows, N, K) in %.1f s", len(cases), time.perf_counter() - start)


class DeviceTimer:
    """Microseconds a call of one way, from a CUDA graph of at least MIN_CALLS calls cycling over copies of a random
    weight that together exceed twice the L2 (each call reads its weight from memory); the fastest of a few
    replays."""

    REPLAYS = 3
    MIN_CALLS = 8

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.l2 = torch.cuda.get_device_properties(device).L2_cache_size
        self._weights: tuple[Shape, list[torch.Tensor]] | None = None

    def weights(self, shape: Shape) -> list[torch.Tensor]:
        if self._weights is None or self._weights[0] != shape:
            self._weights = None  # the last shape's copies go first
            per = shape[0] * shape[1] * torch.empty((), dtype=self.dtype).element_size()
            copies = max(2, math.ceil(2 * self.l2 / per))
            self._weights = (shape, [torch.randn(shape, device=self.device).mul_(0.02).to(self.dtype)
                                     for _ in range(copies)])
        return self._weights[1]

    def __call__(self, shape: Shape, m: int, way: str) -> float:
        ws = self.weights(shape)
        x = torch.randn(m, shape[1], device=self.device).to(self.dtype)
        blocks = plain_gemv_blocks(shape[1])
        call = ((lambda w: F.linear(x, w)) if way == "cublas" else
                (lambda w: triton_gemv(x, w, None, blocks)))
        call(ws[0])  # compiled / warmed outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        calls = max(self.MIN_CALLS, len(ws))
        with torch.cuda.graph(graph):
            for i in range(calls):
                call(ws[i % len(ws)])
        graph.replay()
        best = math.inf
        for _ in range(self.REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / calls)
        del graph
        return best
