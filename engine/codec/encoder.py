"""Encode side of the codec (reference audio -> latent), needed only for voice cloning.

Acoustic branch: DAC encoder (k7 conv, per stride s: 3 residual units + Snake + conv k=2s stride s,
channels doubling; Snake + k3 conv -> D). Semantic branch: HuBERT at 16 kHz (transformers HubertModel),
mean over all hidden states, every `semantic_downsample_factor`-th frame, then the xcodec semantic encoder
(ELU residual units). Frame alignment follows Boson's original `_xcodec_encode` (see `align_acoustic`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from higgs_stream.engine.codec.config import SEMANTIC_HOP, CodecConfig
from higgs_stream.engine.codec.decoder import DILATIONS
from higgs_stream.engine.codec.layers import ResidualUnit, Snake1d
from torch import nn

# ---------------------------------------------------------------- acoustic (DAC) encoder


class EncoderBlock(nn.Module):
    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.res_unit1 = ResidualUnit(channels, DILATIONS[0])
        self.res_unit2 = ResidualUnit(channels, DILATIONS[1])
        self.res_unit3 = ResidualUnit(channels, DILATIONS[2])
        self.snake1 = Snake1d(channels)
        self.conv1 = nn.Conv1d(channels, 2 * channels, kernel_size=2 * stride, stride=stride,
                               padding=math.ceil(stride / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, 2C, ~T/stride]
        x = self.res_unit3(self.res_unit2(self.res_unit1(x)))
        return self.conv1(self.snake1(x))


class AcousticEncoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        c = cfg.encoder_hidden_size
        self.conv1 = nn.Conv1d(1, c, kernel_size=7, padding=3)
        self.block = nn.ModuleList(EncoderBlock(c * 2**i, s) for i, s in enumerate(cfg.encoder_ratios))
        top = c * 2 ** len(cfg.encoder_ratios)
        self.snake1 = Snake1d(top)
        self.conv2 = nn.Conv1d(top, cfg.acoustic_dim, kernel_size=3, padding=1)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:  # [B, 1, T] -> [B, D, F]
        x = self.conv1(wav)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


def acoustic_frames(cfg: CodecConfig, num_samples: int) -> int:
    """Frames the acoustic encoder yields for `num_samples` (stride-1 convs keep length)."""
    n = num_samples
    for s in cfg.encoder_ratios:
        n = (n + 2 * math.ceil(s / 2) - 2 * s) // s + 1
    return n


# ---------------------------------------------------------------- semantic encoder (xcodec)


class SemanticResidualUnit(nn.Module):
    def __init__(self, channels: int, kernel: int, dilation: int):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, channels, kernel, padding=(kernel - 1) // 2 * dilation,
                               dilation=dilation, bias=False)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, F] -> [B, C, F]
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


class SemanticBlock(nn.Module):
    def __init__(self, cfg: CodecConfig, in_channels: int, out_channels: int):
        super().__init__()
        self.res_units = nn.ModuleList(
            SemanticResidualUnit(in_channels, cfg.semantic_unit_kernel_size, d) for d in cfg.semantic_block_dilations)
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size=3, padding=1)  # stride-1 blocks only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        dim, k = cfg.semantic_dim, cfg.semantic_kernel_size
        self.conv = nn.Conv1d(dim, dim, k, padding=k // 2, bias=False)
        blocks, c_in = [], dim
        for ratio in cfg.semantic_channel_ratios:
            blocks.append(SemanticBlock(cfg, c_in, int(dim * ratio)))
            c_in = int(dim * ratio)
        self.conv_blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 768, F] -> [B, 768, F]
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x


# ---------------------------------------------------------------- HuBERT


def build_hubert(cfg: CodecConfig) -> nn.Module:
    """transformers HubertModel in eval mode, positional-conv weight norm removed (a plain `.weight`)."""
    from transformers import HubertConfig, HubertModel

    hcfg: dict[str, Any] = dict(cfg.semantic_model)
    hubert = HubertModel(HubertConfig(**hcfg, mask_time_prob=0.0, mask_feature_prob=0.0))
    conv = hubert.encoder.pos_conv_embed.conv
    if torch.nn.utils.parametrize.is_parametrized(conv, "weight"):
        torch.nn.utils.parametrize.remove_parametrizations(conv, "weight", leave_parametrized=True)
    return hubert.eval()


def semantic_features(hubert: nn.Module, wav: torch.Tensor, cfg: CodecConfig) -> torch.Tensor:
    """[B, 1, T] at cfg.sample_rate -> [B, F_sem, 768]: HuBERT hidden-state mean, strided to the codec rate."""
    import torchaudio

    x = wav[:, 0, :]
    if cfg.sample_rate != cfg.semantic_sample_rate:
        x = torchaudio.functional.resample(x, cfg.sample_rate, cfg.semantic_sample_rate)
    half = SEMANTIC_HOP // 2
    x = F.pad(x, (half, half))  # 160 samples each side at 16 kHz
    hidden = hubert(x, output_hidden_states=True).hidden_states  # (L+1) x [B, F50, 768]
    feats = torch.stack(hidden, dim=1).mean(dim=1)
    return feats[:, :: cfg.semantic_downsample_factor, :]


def align_acoustic(acoustic_encoder: AcousticEncoder, wav: torch.Tensor, e_semantic: torch.Tensor,
                   cfg: CodecConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Boson's original rule: if the branch lengths differ, re-run the acoustic encoder on the waveform
    padded by 160 * semantic_downsample_factor samples per side; if they still differ, trim the longer.

    (transformers' port instead pads hop/2 per side when they differ and never trims.)
    """
    e_acoustic = acoustic_encoder(wav)  # [B, D, Fa]
    if e_acoustic.shape[2] != e_semantic.shape[2]:
        pad = (SEMANTIC_HOP // 2) * cfg.semantic_downsample_factor
        e_acoustic = acoustic_encoder(F.pad(wav, (pad, pad)))
    n = min(e_acoustic.shape[2], e_semantic.shape[2])
    return e_acoustic[:, :, :n], e_semantic[:, :, :n]
