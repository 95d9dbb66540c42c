"""The GEMM form of a convolution over few positions equals PyTorch's convolution (fp32 rounding), for
the shapes the streaming decoders use: dilations, bias or none, ConvTranspose with k = s and k = 2s."""

import pytest
import torch
import torch.nn.functional as F

from higgs_stream.engine.codec import gemm_conv

BOUND = 1e-5  # max |Δ| / max |reference|: a summation-order difference only


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("b,cin,cout,k,dil,length,bias", [
    (1, 64, 96, 7, 1, 10, True), (2, 32, 16, 7, 3, 25, True), (3, 48, 48, 7, 9, 60, False),
    (1, 512, 8, 1, 1, 4, False), (2, 16, 24, 3, 1, 3, True)])
def test_conv1d_gemm_equals_conv1d(b, cin, cout, k, dil, length, bias):
    g = torch.Generator().manual_seed(b * 100 + k * 10 + dil)
    x = torch.randn(b, cin, length, generator=g)
    w = torch.randn(cout, cin, k, generator=g) / (cin * k) ** 0.5
    bvec = torch.randn(cout, generator=g) if bias else None
    want = F.conv1d(x, w, bvec, dilation=dil)
    got = gemm_conv.conv1d_gemm(x, w, bvec, dil)
    assert rel(got, want) <= BOUND


@pytest.mark.parametrize("b,cin,cout,s,double,length,bias", [
    (1, 64, 32, 8, True, 5, True), (2, 32, 16, 5, True, 3, False), (3, 24, 24, 2, False, 4, True),
    (1, 16, 8, 3, True, 1, True)])
def test_conv_transpose1d_gemm_equals_conv_transpose1d(b, cin, cout, s, double, length, bias):
    k = 2 * s if double else s
    g = torch.Generator().manual_seed(b * 100 + s * 10 + length)
    x = torch.randn(b, cin, length, generator=g)
    w = torch.randn(cin, cout, k, generator=g) / cin ** 0.5
    bvec = torch.randn(cout, generator=g) if bias else None
    want = F.conv_transpose1d(x, w, bvec, stride=s)
    got = gemm_conv.conv_transpose1d_gemm(x, w, bvec, s)
    assert got.shape == want.shape == (b, cout, (length - 1) * s + k)
    assert rel(got, want) <= BOUND


def test_dispatch_keeps_pytorch_on_cpu_and_for_grouped_or_large():
    """On CPU (and for grouped convolutions, or more than GEMM_ROWS output rows) the dispatchers are
    PyTorch's own convolution, bit for bit (the same call)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 20, generator=g)
    w = torch.randn(8, 8, 3, generator=g)
    assert torch.equal(gemm_conv.conv1d(x, w, None, 2), F.conv1d(x, w, None, dilation=2))
    dw = torch.randn(8, 1, 7, generator=g)
    assert torch.equal(gemm_conv.conv1d(x, dw, None, 1, groups=8), F.conv1d(x, dw, None, groups=8))
    wt = torch.randn(8, 4, 4, generator=g)
    assert torch.equal(gemm_conv.conv_transpose1d(x, wt, None, 2), F.conv_transpose1d(x, wt, None, stride=2))
