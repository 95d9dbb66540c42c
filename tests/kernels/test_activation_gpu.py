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
