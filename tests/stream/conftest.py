"""Fixtures for the stream tests: a tiny codec with the real Higgs v2 decoder geometry, and a voice
library with one preset (`belinda`) for the message and session tests.

`CodecConfig.tiny()` keeps the real kernel/stride/dilation structure (ratios [8, 5, 4, 2, 3],
hop 960, ±10-frame receptive field) with 64 -> 2 decoder channels. The transformers reference
model is built once with seeded random weights; our `Codec` is loaded from its state dict, so both
decoders compute the same function.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from higgs_stream.engine.codec import Codec, CodecConfig, codec_from_state_dict
from higgs_stream.engine.codec.make import build_reference_model
from higgs_stream.stream.voices import VoiceLibrary


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


def _wav_bytes(seconds=0.5, sr=16000, freq=220.0) -> bytes:
    import soundfile as sf  # here, not at the top: the GPU machine's tests do not need it (nor have it)

    t = np.arange(int(seconds * sr)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32), sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture
def wav_bytes():
    """`wav_bytes(seconds=0.5, sr=16000, freq=220.0)`: a WAV file (s16) of a sine."""
    return _wav_bytes


@pytest.fixture(scope="module")
def voices(tmp_path_factory):
    d = tmp_path_factory.mktemp("voices")
    (d / "belinda.wav").write_bytes(_wav_bytes(0.5))
    (d / "belinda.txt").write_text("Hello, I am Belinda.")
    return VoiceLibrary(d)
