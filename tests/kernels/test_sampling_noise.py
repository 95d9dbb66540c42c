"""The counter-based exponential noise on any device (kernels/sampling_noise.py; the Triton kernel ==
this reference on CUDA: test_sampling_noise_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from higgs_stream.kernels.sampling_noise import exp_from_bits, exp_noise, exp_noise_ref


def test_noise_is_never_zero_or_infinite_at_the_extreme_bits():
    """The largest 32-bit value once gave uniform = 1.0 (fp32 rounding), so noise 0, and in the race
    p / noise a zero-probability id became 0 / 0 = NaN, which argmax picks."""
    bits = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 512, 2**32 - 1], dtype=torch.long)
    noise = exp_from_bits(bits)
    assert (noise > 0).all() and torch.isfinite(noise).all()
    assert noise[-1] == noise[-2] and noise[-1] < 1e-7 and 16.6 < noise[0] < 16.7
    race = torch.tensor([0.0, 1.0]) / exp_from_bits(torch.tensor([2**32 - 1, 2**31], dtype=torch.long))
    assert race.argmax() == 1  # the zero-probability id never wins


def test_noise_is_exp1_and_depends_on_seed_and_counter_only():
    seeds, counters = torch.tensor([3, 3, 4]), torch.tensor([7, 7, 7])
    noise = exp_noise_ref(seeds, counters, 200_000)
    assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.02  # Exp(1): mean = var = 1
    assert (noise > 0).all()


def test_the_fast_path_refuses_strided_seeds_before_it_needs_cuda():
    """exp_noise reads seed b and counter b at offset b: a stride-0 (expanded) or strided view is refused."""

    seeds = torch.arange(4, dtype=torch.long)
    with pytest.raises(AssertionError, match="element offsets"):
        exp_noise(torch.zeros(1, dtype=torch.long).expand(4), seeds, 16)
    with pytest.raises(AssertionError, match="element offsets"):
        exp_noise(seeds, torch.zeros(8, dtype=torch.long)[::2], 16)
