"""The codec's fused narrow layers on CUDA (kernels/codec_layers.py) at the full-size Higgs decoder's shapes (64
channels at 8 kHz, 32 at 24 kHz, dilations 1 / 3 / 9, a 25-frame step of 4 streams) against their definitions on
cuDNN in strict fp32: IEEE products to fp32 rounding, the opt-in TF32 ones to TF32's."""

import pytest
import torch

from higgs_stream.engine.codec.convs import codec_convs
from higgs_stream.kernels import codec_layers as cl

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICE = torch.device("cuda")


def _unit(c: int, d: int, gen: torch.Generator) -> tuple:
    a1, a2 = torch.rand(1, c, 1, generator=gen) + 0.5, torch.rand(1, c, 1, generator=gen) + 0.5
    w1, b1 = torch.randn(c, c, 7, generator=gen) / (7 * c) ** 0.5, torch.randn(c, generator=gen) * 0.1
    w2, b2 = torch.randn(c, c, 1, generator=gen) / c ** 0.5, torch.randn(c, generator=gen) * 0.1
    return tuple(t.to(DEVICE) for t in (a1, w1, b1)) + (d,) + tuple(t.to(DEVICE) for t in (a2, w2, b2))


@pytest.mark.parametrize("c,rate", [(64, 320), (32, 960)])
@pytest.mark.parametrize("d", [1, 3, 9])
def test_the_residual_unit_at_the_decoders_shapes(c, rate, d):
    gen = torch.Generator().manual_seed(c + d)
    args = _unit(c, d, gen)
    n = 25 * rate
    buf = torch.randn(4, c, n + 6 * d, generator=gen).to(DEVICE)
    with torch.no_grad(), codec_convs(DEVICE, allow_tf32=False, cudnn=True):
        want = cl.residual_unit_ref(buf, *args)
    wts = cl.ResidualUnitWeights(*args)
    out = torch.full((4, c, n + 8), float("nan"), device=DEVICE)
    got = cl.residual_unit(buf, wts, out=out[:, :, 8:])
    peak = float(want.abs().max())
    assert float((got - want).abs().max()) / peak < 2e-6 and bool(out[:, :, :8].isnan().all())
    tf32 = cl.residual_unit(buf, wts, precision="tf32")
    err = float((tf32 - want).abs().max()) / peak
    assert 1e-6 < err < 1e-2, err  # TF32's 10-bit mantissa shows, and stays small


def test_the_last_conv_at_the_decoders_shape():
    gen = torch.Generator().manual_seed(7)
    buf = torch.randn(4, 32, 25 * 960 + 6, generator=gen).to(DEVICE)
    alpha = (torch.rand(1, 32, 1, generator=gen) + 0.5).to(DEVICE)
    w, b = (torch.randn(1, 32, 7, generator=gen) / 15).to(DEVICE), torch.randn(1, generator=gen).to(DEVICE)
    with torch.no_grad(), codec_convs(DEVICE, allow_tf32=False, cudnn=True):
        want = cl.snake_conv_out_ref(buf, alpha, w, b)
    got = cl.snake_conv_out(buf, cl.ConvOutWeights(alpha, w, b))
    assert got.shape == want.shape and float((got - want).abs().max() / want.abs().max()) < 2e-6
