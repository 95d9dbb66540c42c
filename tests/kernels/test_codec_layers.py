"""The codec's fused narrow layers (kernels/codec_layers.py): the plain-torch definitions against the decoder's own
modules (CPU), the Triton kernels against those definitions under Triton's interpreter (CPU, fp32: channel counts
that are and are not powers of two, dilations 1 / 3 / 9, position counts off the block size, a centred and a causal
skip, output into a strided view whose neighbours stay untouched), and their compile for sm_90 (the products in IEEE
fp32 on the FMA units by default, on tensor cores only in the opt-in TF32 mode). On the GPU:
tests/engine/test_codec_streaming_gpu.py (the stateful decoder with them vs the one-shot decode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from higgs_stream.engine.codec.layers import ResidualUnit
from higgs_stream.kernels import codec_layers as cl
from higgs_stream.kernels.snake import snake_ref


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("dilation", [1, 3, 9])
def test_the_residual_definition_is_the_decoders_unit_on_an_unpadded_buffer(dilation):
    torch.manual_seed(dilation)
    ru = ResidualUnit(8, dilation)
    with torch.no_grad():
        for p in (ru.snake1.alpha, ru.snake2.alpha):
            p.uniform_(0.5, 1.5)
        x = torch.randn(2, 8, 50)
        want = ru(x)  # "same" padding inside the module
        got = cl.residual_unit_ref(F.pad(x, (3 * dilation, 3 * dilation)), ru.snake1.alpha, ru.conv1.weight,
                                   ru.conv1.bias, dilation, ru.snake2.alpha, ru.conv2.weight, ru.conv2.bias)
    assert got.shape == want.shape and _rel(got, want) < 1e-6


def test_the_conv_out_definition_is_snake_then_the_conv():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(8, 1, 7, padding=3)
    alpha = torch.rand(1, 8, 1) + 0.5
    x = torch.randn(3, 8, 40)
    with torch.no_grad():
        want = conv(snake_ref(x, alpha))
        got = cl.snake_conv_out_ref(F.pad(x, (3, 3)), alpha, conv.weight, conv.bias)
    assert got.shape == (3, 1, 40) and _rel(got, want) < 1e-6


def test_a_unit_of_more_channels_than_the_kernel_takes_is_refused():
    c = cl.MAX_CHANNELS * 2
    wts = cl.ResidualUnitWeights(torch.ones(c), torch.zeros(c, c, 7), torch.zeros(c), 1, torch.ones(c),
                                 torch.zeros(c, c, 1), torch.zeros(c))
    with pytest.raises(AssertionError, match="at most 128 channels"):
        cl.launch_residual_unit(torch.zeros(1, c, 20), wts)


SCRIPT = r"""
import json, torch
from higgs_stream.kernels import codec_layers as cl
g = torch.Generator().manual_seed(0)
out = []
for c, d, n, skip, bt in [(32, 1, 300, None, None), (16, 3, 7, None, 16), (24, 9, 130, 54, 32), (64, 3, 65, None, None)]:
    taps = 7
    buf = torch.randn(3, c, n + (taps - 1) * d, generator=g)
    a1, a2 = torch.rand(1, c, 1, generator=g) + 0.5, torch.rand(1, c, 1, generator=g) + 0.5
    w1, b1 = torch.randn(c, c, taps, generator=g) / (c * taps) ** 0.5, torch.randn(c, generator=g)
    w2, b2 = torch.randn(c, c, 1, generator=g) / c ** 0.5, torch.randn(c, generator=g)
    wts = cl.ResidualUnitWeights(a1, w1, b1, d, a2, w2, b2, skip)
    big = torch.full((3, c, n + 5), float("nan"))
    cl.launch_residual_unit(buf, wts, out=big[:, :, 5:], block_t=bt)
    want = cl.residual_unit_ref(buf, a1, w1, b1, d, a2, w2, b2, skip)
    out.append(["res", c, float((big[:, :, 5:] - want).abs().max() / want.abs().max()),
                bool(big[:, :, :5].isnan().all())])
for c, d, n in [(32, 1, 1000), (24, 2, 5)]:
    buf = torch.randn(2, c, n + 6 * d, generator=g)
    a = torch.rand(1, c, 1, generator=g) + 0.5
    w, b = torch.randn(1, c, 7, generator=g) / (7 * c) ** 0.5, torch.randn(1, generator=g)
    got = cl.launch_conv_out(buf, cl.ConvOutWeights(a, w, b, d))
    want = cl.snake_conv_out_ref(buf, a, w, b, d)
    out.append(["out", c, float((got - want).abs().max() / want.abs().max()), tuple(got.shape) == tuple(want.shape)])
print(json.dumps(out))
"""


def test_the_kernels_in_the_interpreter(interpret):
    rows = interpret(SCRIPT)
    assert [r[:2] for r in rows] == [["res", 32], ["res", 16], ["res", 24], ["res", 64], ["out", 32], ["out", 24]]
    for kind, c, err, ok in rows:
        assert err < 2e-6 and ok, (kind, c, err, ok)  # fp32 rounding; the out view's neighbours / shape kept


@pytest.mark.parametrize("precision", ["ieee", "tf32"])
def test_the_residual_kernel_compiles_for_hopper(compile_for_hopper, precision):
    _, kernel, _ = cl._kernels()
    consts = {"DIL": 9, "TAPS": 7, "SKIP": 27, "CP": 32, "BT": 128, "PRECISION": precision}
    sig = {**dict.fromkeys(("buf_ptr", "a1_ptr", "w1_ptr", "b1_ptr", "a2_ptr", "w2_ptr", "b2_ptr", "out_ptr"), "*fp32"),
           **dict.fromkeys(("n", "channels", "buf_row", "buf_ch", "out_row", "out_ch"), "i32"),
           **dict.fromkeys(consts, "constexpr")}
    ptx = compile_for_hopper(kernel, sig, consts, num_warps=4).asm["ptx"]
    assert ("mma" in ptx) == (precision == "tf32")  # IEEE fp32: no tensor-core product
    assert "fma.rn.f32" in ptx
