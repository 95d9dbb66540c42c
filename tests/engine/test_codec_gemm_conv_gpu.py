"""On CUDA the dispatchers take the GEMM path up to GEMM_ROWS output rows and cuDNN above, and both equal
PyTorch's convolution to fp32 rounding (TF32 off, as the exact codec runs)."""

import pytest
import torch
import torch.nn.functional as F

from higgs_stream.engine.codec import gemm_conv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("length", [10, 40, 400])  # 4 and 34 output rows (GEMM), 394 (cuDNN)
def test_dispatch_on_cuda(length, monkeypatch):
    calls = []
    monkeypatch.setattr(gemm_conv, "conv1d_gemm", lambda *a: calls.append(1) or F.conv1d(*a[:3], dilation=a[3]))
    g = torch.Generator(device="cuda").manual_seed(length)
    x = torch.randn(1, 1536, length, device="cuda", generator=g)
    w = torch.randn(768, 1536, 7, device="cuda", generator=g) / 100
    gemm_conv.conv1d(x, w, None, 1)
    assert bool(calls) == (length - 6 <= gemm_conv.GEMM_ROWS)


def test_gemm_paths_equal_cudnn_fp32(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # restored after the test: later tests
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # see the process defaults
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 1536, 10, device="cuda", generator=g)
    w = torch.randn(768, 1536, 7, device="cuda", generator=g) / 100
    bias = torch.randn(768, device="cuda", generator=g)
    assert rel(gemm_conv.conv1d_gemm(x, w, bias, 1), F.conv1d(x, w, bias)) <= 1e-5
    wt = torch.randn(1536, 768, 16, device="cuda", generator=g) / 40
    assert rel(gemm_conv.conv_transpose1d_gemm(x, wt, bias, 8), F.conv_transpose1d(x, wt, bias, stride=8)) <= 1e-5
