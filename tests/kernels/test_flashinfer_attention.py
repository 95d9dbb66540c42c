"""CPU-side checks of the FlashInfer wrapper (the GPU comparisons are in *_gpu.py)."""

import pytest


def test_head_dims_without_a_flashinfer_kernel_are_refused_by_name():
    """Runs on CPU too: the check happens before any FlashInfer call (tiny presets use head_dim 16)."""
    from higgs_stream.kernels._triton import KernelUnavailableError
    from higgs_stream.kernels.flashinfer_attention import check_head_dim

    for ok in (64, 128, 256):
        check_head_dim(ok)
    with pytest.raises(KernelUnavailableError, match=r"supports head_dim \(64, 128, 256\), this model has 16"):
        check_head_dim(16)
