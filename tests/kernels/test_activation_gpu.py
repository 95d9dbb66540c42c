"""Triton silu_and_mul == the plain-torch reference (CUDA only)."""

import pytest
import torch

from higgs_stream.kernels.activation import silu_and_mul, silu_and_mul_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("n,inter", [(1, 8192), (33, 8192), (7, 100)])
def test_matches_ref(n, inter):
    x = (torch.randn(n, 2 * inter, device="cuda") * 2).bfloat16()
    want, got = silu_and_mul_ref(x), silu_and_mul(x)
    assert got.shape == (n, inter) and got.dtype == torch.bfloat16
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 4e-3, err


@pytest.mark.parametrize("n,inter", [(17, 8192), (256, 6144), (33, 100)])
def test_fp8_rows_equal_the_unfused_pair(n, inter):
    """`silu_and_mul_fp8` == `silu_and_mul` then `quantize_per_token`: the same e4m3 bytes and scales."""
    from higgs_stream.kernels.activation import silu_and_mul_fp8
    from higgs_stream.kernels.fp8_linear import quantize_per_token

    x = (torch.randn(n, 2 * inter, device="cuda") * 3).bfloat16()
    want_q, want_s = quantize_per_token(silu_and_mul(x))
    got = silu_and_mul_fp8(x)
    assert torch.equal(got.scale, want_s)
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
