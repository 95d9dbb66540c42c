"""Triton Snake == the plain-torch reference (CUDA only), and the codec uses it on CUDA."""

import pytest
import torch

from higgs_stream.kernels.snake import snake, snake_beta, snake_beta_ref, snake_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("b,c,t", [(1, 32, 24000), (3, 1024, 45), (2, 64, 1001), (1, 5, 1)])
def test_matches_ref(b, c, t):
    x = torch.randn(b, c, t, device="cuda") * 3
    alpha = torch.rand(1, c, 1, device="cuda") * 2 + 0.05
    got = snake(x, alpha)
    want = snake_ref(x.double(), alpha.double()).float()
    assert got.shape == x.shape and torch.isfinite(got).all()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-6, err


@pytest.mark.parametrize("b,c,t", [(1, 96, 48000), (2, 1536, 4), (1, 7, 1)])
def test_snake_beta_matches_ref(b, c, t):
    x = torch.randn(b, c, t, device="cuda") * 3
    la, lb = torch.randn(c, device="cuda") * 0.5, torch.randn(c, device="cuda") * 0.5
    got = snake_beta(x, la, lb)
    want = snake_beta_ref(x.double(), la.double(), lb.double()).float()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-6, err


def test_codec_decode_on_cuda_uses_the_kernel_and_matches_cpu():
    from higgs_stream.engine.codec import Codec, CodecConfig

    torch.manual_seed(0)
    cpu = Codec(CodecConfig.tiny(), with_encoder=False)
    for p in cpu.parameters():  # non-trivial alphas
        if p.dim() == 3 and p.shape[0] == 1:
            p.data.uniform_(0.2, 2.0)
    gpu = Codec(CodecConfig.tiny(), with_encoder=False).cuda()
    gpu.load_state_dict(cpu.state_dict())
    codes = torch.randint(0, 1024, (2, 8, 30))
    want, got = cpu.decode(codes), gpu.decode(codes.cuda()).cpu()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-5, err
