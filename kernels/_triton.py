"""Lazy access to Triton for the GPU fast paths.

Importing a fast-path module never imports Triton; the first GPU call does. A missing Triton on a
CUDA machine raises `KernelUnavailableError` naming what to install: the fast path never falls back
to the plain-torch reference on its own (callers choose `kernels="ref"` explicitly for that).
"""

from __future__ import annotations

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
