"""The 12 Hz tokenizer's encoder against the official reference (PyPI qwen-tts 0.1.1, fixtures made by
scripts/qwen3_reference_fixtures.py: a tiny Mimi encoder whose latent is wider than its codebooks, 20
quantizers of which 16 are kept), the numpy entry point (any rate and channels, cache by content), and
loading errors."""

import json
import shutil

import numpy as np
import pytest
import torch
from higgs_stream.engine.codec.audio_io import to_codec_rate
from higgs_stream.engine.errors import AudioInputError, CheckpointError, InvalidInputError
from higgs_stream.engine.models.qwen3_tts.codec import load_qwen_codec
from higgs_stream.testing import check_tensors_are_named
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def codec(tiny_dir):
    return load_qwen_codec(tiny_dir)


def _pcm(ref, row: int) -> torch.Tensor:
    return torch.from_numpy(ref["encode_pcm"][row].astype(np.float32) / 32768.0)  # stored as s16: exact


def test_codes_equal_the_reference(codec, ref):
    """The reference encoded both 0.5 s rows as one batch and kept ceil(valid / 1920) frames of each
    (row 1's mask says 9000 valid samples); every code must be equal."""
    wav = torch.stack([_pcm(ref, 0), _pcm(ref, 1)])[:, None]  # [2, 1, 12000]
    codes = codec.encode_tensor(wav)  # [2, 16, 7]
    assert codes.shape == (2, 16, 7)
    assert np.array_equal(codes[0].T.numpy(), ref["encode_codes_0"])
    n = -(-int(ref["encode_lengths"][1]) // 1920)
    assert np.array_equal(codes[1, :, :n].T.numpy(), ref["encode_codes_1"])


def test_encode_is_causal_and_covers_every_sample(codec, ref):
    wav = _pcm(ref, 0)
    whole = codec.encode_tensor(wav[None, None])[0]  # [16, 7]
    part = codec.encode_tensor(wav[None, None, :9000])[0]  # ceil(9000 / 1920) = 5 frames
    assert part.shape == (16, 5)
    assert torch.equal(part[:, :4], whole[:, :4])  # frames 0..3 see only samples before 9000


def test_numpy_any_rate_any_channels_and_the_cache(codec, ref, monkeypatch):
    mono = _pcm(ref, 0).numpy()
    assert np.array_equal(codec.encode(mono, 24000), ref["encode_codes_0"].T)
    stereo48 = np.stack([mono, 0.5 * mono]).repeat(2, axis=1)  # [2, 24000] at 48 kHz
    want = codec.encode_tensor(torch.from_numpy(to_codec_rate(stereo48, 48000))[None, None])[0].numpy()
    calls = []
    real = codec.encode_tensor
    monkeypatch.setattr(codec, "encode_tensor", lambda x: calls.append(x.shape[-1]) or real(x))
    assert np.array_equal(codec.encode(stereo48, 48000), want)
    assert np.array_equal(codec.encode(stereo48.copy(), 48000), want) and calls == [12000]  # a hit by content
    got = codec.encode(stereo48, 48000)
    got[:] = -1  # a copy: the cache is not the caller's
    assert np.array_equal(codec.encode(stereo48, 48000), want)
    with pytest.raises(AudioInputError, match="too short"):
        codec.encode(mono[:100], 24000)
    with pytest.raises(AudioInputError, match="too long"):
        codec.encode(np.tile(mono, 3), 24000, max_seconds=1.0)


def test_loading_names_a_wrong_encoder_tensor(tmp_path, tiny_dir):
    root = tmp_path / "st"
    shutil.copytree(tiny_dir / "speech_tokenizer", root)
    weights = check_tensors_are_named(root / "model.safetensors", lambda: load_qwen_codec(root),
                                      "encoder.quantizer.acoustic_residual_vector_quantizer.input_proj.weight",
                                      "encoder.extra.weight", "encoder.downsample.conv.weight", (3, 3, 3))
    save_file({k: v for k, v in weights.items() if not k.startswith("encoder.")}, root / "model.safetensors")
    decode_only = load_qwen_codec(root)  # no encoder.* at all: it decodes, and says why it cannot encode
    assert not decode_only.can_encode
    with pytest.raises(InvalidInputError, match="takes no reference audio"):
        decode_only.encode(np.ones(4800, np.float32), 24000)
    save_file(weights, root / "model.safetensors")
    raw = json.loads((root / "config.json").read_text())
    raw["encoder_config"]["frame_rate"] = raw["encoder_config"].pop("_frame_rate") * 2
    (root / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="frame_rate"):
        load_qwen_codec(root)
