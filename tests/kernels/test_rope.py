import math

import torch
from transformers import HiggsAudioV2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from higgs_stream.kernels.rope import apply_rope_ref, llama3_inv_freq, rope_cos_sin

ORIGINAL = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # Boson's config.json text_config
HF_PORT = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 0.125, "high_freq_factor": 0.5,
           "original_max_position_embeddings": 1024}  # transformers' HiggsAudioV2Config default


def test_original_and_port_parameters_give_the_same_frequencies():
    a = llama3_inv_freq(128, 500000.0, ORIGINAL)
    b = llama3_inv_freq(128, 500000.0, HF_PORT)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    plain = llama3_inv_freq(128, 500000.0, None)
    assert not torch.allclose(a, plain)  # scaling really changes the low frequencies


def test_matches_transformers_llama3_init():
    cfg = HiggsAudioV2Config()  # full-size head_dim 128, the port's rope parameters
    ref, scale = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    assert scale == 1.0
    assert torch.equal(llama3_inv_freq(128, 500000.0, cfg.rope_parameters), ref)


def test_llama3_bands_by_hand():
    plain = llama3_inv_freq(128, 500000.0, None)
    torch.testing.assert_close(plain, 500000.0 ** (-torch.arange(0, 128, 2).double() / 128), check_dtype=False)
    scaled = llama3_inv_freq(128, 500000.0, ORIGINAL)
    wavelength = 2 * math.pi / plain
    high = wavelength < 8192 / 4  # shorter than 2048: untouched
    low = wavelength > 8192 / 1  # longer than 8192: divided by 32
    assert high.any() and low.any() and (~high & ~low).any()
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 32)
    mid = ~high & ~low
    s = (8192 / wavelength[mid] - 1) / 3
    torch.testing.assert_close(scaled[mid], (1 - s) * plain[mid] / 32 + s * plain[mid])


def test_apply_rope_equals_complex_rotation():
    gen = torch.Generator().manual_seed(0)
    n, h, d = 11, 3, 16
    x = torch.randn(n, h, d, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, 5000, (n,), generator=gen)
    inv_freq = llama3_inv_freq(d, 10000.0, None).double()
    cos, sin = rope_cos_sin(positions, inv_freq, torch.float64)
    got = apply_rope_ref(x, cos, sin)
    # pairs (i, i + d/2) are the real and imaginary parts of one complex number
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :])
    angle = (positions.float()[:, None] * inv_freq.float()[None, :]).double()  # [n, d/2], fp32 like HF
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    expect = torch.cat((z.real, z.imag), dim=-1)
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)  # cos/sin are fp32


def test_scores_depend_only_on_relative_position():
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 32, generator=gen), torch.randn(1, 1, 32, generator=gen)
    inv_freq = llama3_inv_freq(32, 500000.0, ORIGINAL)

    def score(m: int, n: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([m]), inv_freq, torch.float32)
        ck, sk = rope_cos_sin(torch.tensor([n]), inv_freq, torch.float32)
        return (apply_rope_ref(q, cq, sq) * apply_rope_ref(k, ck, sk)).sum().item()

    assert abs(score(10, 3) - score(107, 100)) < 1e-4
    assert abs(score(10, 3) - score(10, 4)) > 1e-3
