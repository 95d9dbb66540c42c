"""Fixtures for the stream tests: a tiny codec with the real Higgs v2 decoder geometry.

`CodecConfig.tiny()` keeps the real kernel/stride/dilation structure (ratios [8, 5, 4, 2, 3],
hop 960, ±10-frame receptive field) with 64 -> 2 decoder channels. The transformers reference
model is built once with seeded random weights; our `Codec` is loaded from its state dict, so both
decoders compute the same function.
"""

from __future__ import annotations

import pytest
import torch

from higgs_stream.engine.codec import Codec, CodecConfig, codec_from_state_dict
from higgs_stream.engine.codec.make import build_reference_model


class CountingDecoder:
    """Wraps a decode callable and records the shape of every codec call."""

    hop = 960
    receptive_field = 10

    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[tuple[int, ...]] = []

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(codes.shape))
        return self.fn(codes)


@pytest.fixture(scope="session")
def reference_model():
    """transformers' HiggsAudioV2TokenizerModel, tiny, seeded random weights."""
    return build_reference_model(CodecConfig.tiny(), seed=7)


@pytest.fixture(scope="session")
def codec(reference_model) -> Codec:
    return codec_from_state_dict(reference_model.state_dict(), CodecConfig.tiny(), with_encoder=False)


@pytest.fixture
def counting_codec(codec) -> CountingDecoder:
    return CountingDecoder(codec.decode)
