"""Fixtures for the stream tests: a tiny codec decoder with the real Higgs v2 decoder geometry."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn


def build_reference_codec(seed: int = 0):
    """transformers' HiggsAudioV2TokenizerModel with the real decoder structure, tiny widths.

    Ratios [8, 5, 4, 2, 3] (hop 960), 8 quantizers of 1024, DAC decoder k7 convs and dilations
    1/3/9 as in the real codec, but 64 -> 2 channels. Weights are random with unit-gain scaling
    (the default init zeroes the codebooks, which would make every code decode the same), and the
    output is scaled to a speech-like RMS of about 0.2.
    """
    from transformers import HiggsAudioV2TokenizerConfig, HiggsAudioV2TokenizerModel

    torch.manual_seed(seed)
    cfg = HiggsAudioV2TokenizerConfig(
        target_bandwidths=[0.5, 1, 1.5, 2],  # -> 8 quantizers at 25 frames/s, 10 bits each
        codebook_size=1024,
        codebook_dim=8,
        acoustic_model_config=dict(
            encoder_hidden_size=4,
            downsampling_ratios=[8, 5, 4, 2, 3],
            decoder_hidden_size=64,
            upsampling_ratios=[8, 5, 4, 2, 3],
            hidden_size=16,
        ),
        semantic_model_config=dict(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            conv_dim=[8, 8],
            conv_stride=[5, 2],
            conv_kernel=[10, 3],
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
        ),
    )
    assert cfg.hop_length == 960 and cfg.num_quantizers == 8, (cfg.hop_length, cfg.num_quantizers)
    model = HiggsAudioV2TokenizerModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in model.quantizer.quantizers:
            q.codebook.embed.copy_(torch.randn(q.codebook.embed.shape, generator=g))
        for mod in [*model.quantizer.modules(), model.fc2, *model.acoustic_decoder.modules()]:
            if isinstance(mod, (nn.Linear, nn.Conv1d, nn.ConvTranspose1d)):
                w = mod.weight
                if isinstance(mod, nn.ConvTranspose1d):
                    fan_in = w.shape[0] * w.shape[2] / mod.stride[0]
                else:
                    fan_in = w.shape[1] * (w.shape[2] if w.dim() == 3 else 1)
                w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(fan_in))
                if mod.bias is not None:
                    mod.bias.copy_(0.1 * torch.randn(mod.bias.shape, generator=g))
            if type(mod).__name__ == "Snake1d":
                mod.alpha.copy_(0.5 + torch.rand(mod.alpha.shape, generator=g))
        for mod in model.acoustic_decoder.modules():  # damp the residual branches: keeps the
            if type(mod).__name__ == "DacResidualUnit":  # activations O(10) as in a trained codec
                mod.conv2.weight.mul_(0.2)
        probe = model.decode(torch.randint(0, 1024, (1, 8, 50), generator=g)).audio_values
        final = model.acoustic_decoder.conv2
        scale = 0.2 / float(probe.std())
        final.weight.mul_(scale)
        final.bias.mul_(scale)
    return model


class ReferenceDecoder:
    """decode_fn(codes [B, 8, F] long) -> [B, F * 960] float32 through the transformers model."""

    hop = 960
    receptive_field = 10

    def __init__(self, model) -> None:
        self.model = model
        self.calls: list[tuple[int, ...]] = []

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(codes.shape))
        with torch.no_grad():
            return self.model.decode(codes).audio_values[:, 0]  # [B, F * 960]


@pytest.fixture(scope="session")
def ref_model():
    return build_reference_codec()


@pytest.fixture
def ref_decoder(ref_model) -> ReferenceDecoder:
    return ReferenceDecoder(ref_model)
