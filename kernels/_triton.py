"""Lazy access to Triton for the GPU fast paths.

Importing a fast-path module never imports Triton; the first GPU call does. A missing Triton on a
CUDA machine raises `KernelUnavailableError` naming what to install: the fast path never falls back
to the plain-torch reference on its own (callers choose `kernels="ref"` explicitly for that).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any


class KernelUnavailableError(RuntimeError):
    """A GPU kernel was asked for but its library (Triton, FlashInfer) or a CUDA device is missing.

    (kernels/ imports nothing from engine/; the engine turns this into a typed ConfigError.)
    """


@functools.cache
def triton_modules() -> tuple[Any, Any]:
    """(triton, triton.language); KernelUnavailableError when Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise KernelUnavailableError(f"the GPU fast path needs Triton (pip install triton): {exc}") from exc
    return triton, tl


def require_cuda(*tensors: Any, what: str) -> None:
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise KernelUnavailableError(f"{what} is a CUDA kernel; got a tensor on {t.device} "
                                         f"(use the *_ref function on CPU)")


# Programmatic dependent launch (Hopper and later; ModelRunnerConfig.pdl_max_rows, bench_quant --pdl-max-rows): the
# decode step's Triton kernels are launched with CUDA's programmatic stream serialization, so each may start while the
# kernel before it on its stream is still ending (in a CUDA graph too: the capture keeps the edges programmatic). The
# kernel's first instruction waits until that kernel has finished and its writes are visible (`griddepcontrol.wait`;
# nothing is read or written before it), the second lets the next kernel launch (`griddepcontrol.launch_dependents`):
# the same results, launch latency hidden. Process-wide; the model runner turns it on only while it captures the
# decode graphs of few rows (`pdl`). Measured (H200, session 23): the whole v2 step at one row 1.60 vs 1.76 ms (fp8),
# 2.47 vs 2.54-2.56 (bf16), but 2-4 % slower at 128-256 rows. The GEMV prefetching its weight rows into L2 before its
# wait (session 22) made one fp8 row slower instead (1.80 vs 1.77 ms): removed.
_PDL = {"on": False}


@contextlib.contextmanager
def pdl(on: bool):
    """PDL on or off for the launches inside the block (a graph capture's; a CUDA device of compute capability 9.0
    or later, the caller checks), then as it was."""
    was = _PDL["on"]
    _PDL["on"] = bool(on)
    try:
        yield
    finally:
        _PDL["on"] = was


def pdl_args() -> dict[str, bool]:
    """A kernel launch's PDL arguments: its `PDL` constexpr (with it the kernel's first instructions are
    `gdc_wait`, then `gdc_launch_dependents`) and Triton's `launch_pdl` option."""
    on = _PDL["on"]
    return {"PDL": on, "launch_pdl": on}
