"""The convolution settings the codecs decode under: one switch for cuDNN, TF32 and CPU kernels, shared by both
codec families' `precision()` and by the stateful decoder's check against PyTorch's native convolutions
(engine/codec/arena.py). A leaf module: the codec and the arena both import it."""

from __future__ import annotations

import contextlib

import torch


def codec_convs(device: torch.device, allow_tf32: bool, cudnn: bool) -> contextlib.AbstractContextManager:
    """The convolution settings a codec decodes under (both families' `precision()`): on CUDA fp32 without TF32 (or,
    `allow_tf32`, as torch is set), on cuDNN unless `cudnn` is False (PyTorch's native kernels then, fp32); on CPU
    PyTorch's native kernels (`native_cpu_convs`)."""
    if allow_tf32 and cudnn:
        return contextlib.nullcontext()
    if device.type != "cuda":
        return native_cpu_convs()
    b = torch.backends.cudnn
    return b.flags(enabled=b.enabled and cudnn, benchmark=b.benchmark, benchmark_limit=b.benchmark_limit,
                   deterministic=b.deterministic, allow_tf32=False)


@contextlib.contextmanager
def native_cpu_convs():
    """Route CPU convolutions to PyTorch's native kernels for the duration (restores the flag)."""
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous
