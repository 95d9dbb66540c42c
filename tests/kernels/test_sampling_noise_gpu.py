"""Triton counter-based noise == the int64 torch reference bit for bit (CUDA only)."""

import pytest
import torch

from higgs_stream.kernels.sampling_noise import exp_noise, exp_noise_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_matches_ref():
    seeds = torch.tensor([0, 1, 2**62 + 12345, 2**63 - 1, 987654321], device="cuda")
    counters = torch.tensor([0, 1, 7, 2**40 + 3, 250], device="cuda")
    got, want = exp_noise(seeds, counters, 16416), exp_noise_ref(seeds, counters, 16416)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)  # identical bits, log may differ by an ulp
    assert got.min() > 0 and torch.isfinite(got).all()
    assert abs(got.mean().item() - 1.0) < 0.02  # Exp(1)
