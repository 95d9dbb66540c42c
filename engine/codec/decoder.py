"""DAC acoustic decoder (Code2Wav's conv stack) and its exact receptive-field geometry.

decoder: k7 conv D->C, then per stride s: Snake, ConvTranspose1d(k=2s, stride s, pad ceil(s/2),
output_padding s%2) C->C/2, three residual units (dilations 1/3/9); then Snake and k7 conv -> 1 channel.
No tanh. Output length is exactly F * prod(strides).
"""

from __future__ import annotations

import math

import torch
from higgs_stream.engine.codec.config import CodecConfig
from higgs_stream.engine.codec.layers import ResidualUnit, Snake1d
from torch import nn

DILATIONS = (1, 3, 9)


class DecoderBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.snake1 = Snake1d(in_channels)
        self.conv_t1 = nn.ConvTranspose1d(in_channels, out_channels, kernel_size=2 * stride, stride=stride,
                                          padding=math.ceil(stride / 2), output_padding=stride % 2)
        self.res_unit1 = ResidualUnit(out_channels, DILATIONS[0])
        self.res_unit2 = ResidualUnit(out_channels, DILATIONS[1])
        self.res_unit3 = ResidualUnit(out_channels, DILATIONS[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, Cin, T] -> [B, Cout, T*stride]
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class AcousticDecoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        c = cfg.decoder_hidden_size
        self.conv1 = nn.Conv1d(cfg.acoustic_dim, c, kernel_size=7, padding=3)
        self.block = nn.ModuleList(
            DecoderBlock(c // 2**i, c // 2 ** (i + 1), s) for i, s in enumerate(cfg.decoder_ratios))
        out = c // 2 ** len(cfg.decoder_ratios)
        self.snake1 = Snake1d(out)
        self.conv2 = nn.Conv1d(out, 1, kernel_size=7, padding=3)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:  # [B, D, F] -> [B, 1, F*hop]
        x = self.conv1(latent)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


def influence_interval(cfg: CodecConfig, frame: int) -> tuple[int, int]:
    """Output samples [lo, hi] (inclusive) that latent frame `frame` can change, ignoring sequence ends.

    Forward interval propagation: a stride-1 conv (k, dilation d, padding p) maps input i to outputs
    i + p - (k-1)d .. i + p; a transposed conv (k, stride s, padding p) maps input i to i*s - p .. i*s - p + k - 1;
    residual units add the identity (a superset is the same interval); Snake is pointwise.
    """
    lo, hi = frame - 3, frame + 3  # conv1 k7 p3
    for s in cfg.decoder_ratios:
        k, p = 2 * s, math.ceil(s / 2)
        lo, hi = lo * s - p, hi * s - p + k - 1
        for d in DILATIONS:
            lo, hi = lo - 3 * d, hi + 3 * d  # k7 conv, padding 3d; the k1 conv is pointwise
    return lo - 3, hi + 3  # conv2 k7 p3
