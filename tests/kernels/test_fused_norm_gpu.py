"""Triton add + RMSNorm == the plain-torch reference (CUDA only)."""

import pytest
import torch

from higgs_stream.kernels.fused_norm import add_rms_norm, add_rms_norm_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("n,h,stacked,with_delta", [(1, 3072, False, False), (37, 3072, True, True), (256, 3072, False, True), (5, 64, True, False)])
def test_matches_ref(n, h, stacked, with_delta):
    gen = torch.Generator(device="cuda").manual_seed(n + h)
    res = torch.randn(n, h, device="cuda", generator=gen) * 3
    delta = torch.randn(n, h, device="cuda", generator=gen).bfloat16() if with_delta else None
    weight = (1 + 0.1 * torch.randn(2 if stacked else 1, h, device="cuda", generator=gen)).bfloat16()
    select = torch.randint(0, 2, (n,), device="cuda", generator=gen, dtype=torch.int32) if stacked else None
    res_ref = res.clone()
    want = add_rms_norm_ref(delta, res_ref, weight, 1e-5, select)
    got = add_rms_norm(delta, res, weight, 1e-5, select)
    torch.testing.assert_close(res, res_ref, rtol=1e-6, atol=1e-6)  # residual updated identically
    assert got.dtype == torch.bfloat16
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 4e-3, err  # at most bf16 rounding of the output


@pytest.mark.parametrize("n,stacked,with_delta", [(17, False, True), (256, True, True), (64, False, False)])
def test_fp8_rows_equal_the_unfused_pair(n, stacked, with_delta):
    """`add_rms_norm_fp8` == `add_rms_norm` then `quantize_per_token`: the same e4m3 bytes and scales, the same
    residual update."""
    from higgs_stream.kernels.fp8_linear import quantize_per_token
    from higgs_stream.kernels.fused_norm import add_rms_norm_fp8

    gen = torch.Generator(device="cuda").manual_seed(n)
    res = torch.randn(n, 3072, device="cuda", generator=gen) * 3
    delta = torch.randn(n, 3072, device="cuda", generator=gen).bfloat16() if with_delta else None
    weight = (1 + 0.1 * torch.randn(2 if stacked else 1, 3072, device="cuda", generator=gen)).bfloat16()
    select = torch.randint(0, 2, (n,), device="cuda", generator=gen, dtype=torch.int32) if stacked else None
    res_fused = res.clone()
    want_q, want_s = quantize_per_token(add_rms_norm(delta, res, weight, 1e-5, select))
    got = add_rms_norm_fp8(delta, res_fused, weight, 1e-5, select)
    assert torch.equal(res_fused, res)
    assert torch.equal(got.scale, want_s)
    assert torch.equal(got.q.view(torch.uint8), want_q.view(torch.uint8))
