import pytest
import torch
from transformers.models.higgs_audio_v2.modeling_higgs_audio_v2 import HiggsAudioV2RMSNorm

from higgs_stream.kernels.norm import rms_norm_ref


def test_matches_float64_formula():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, 64, generator=gen) * 3
    w = torch.randn(64, generator=gen)
    x64 = x.double()
    expect = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    got = rms_norm_ref(x, w, 1e-5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_rmsnorm(dtype):
    gen = torch.Generator().manual_seed(1)
    ref = HiggsAudioV2RMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(48, generator=gen))
    x = torch.randn(10, 48, generator=gen).to(dtype)
    got = rms_norm_ref(x, ref.weight, 1e-5)
    assert got.dtype == dtype
    assert torch.equal(got, ref(x))  # same op order: fp32 statistics, cast, then scale


def test_eps_guards_zero_rows():
    out = rms_norm_ref(torch.zeros(2, 8), torch.ones(8), 1e-5)
    assert torch.equal(out, torch.zeros(2, 8))
