"""The Base variant's speaker encoder (log-mel + ECAPA-TDNN x-vector) against the official reference
(PyPI qwen-tts 0.1.1 `extract_speaker_embedding`, fixtures made by scripts/qwen3_reference_fixtures.py
on the tiny Base checkpoint), its codec-side entry point, and loading errors."""

import json
import shutil

import numpy as np
import pytest
import torch
from higgs_stream.engine.codec.audio_io import to_codec_rate
from higgs_stream.engine.errors import CheckpointError
from higgs_stream.engine.models.qwen3_tts.speaker import SpeakerEncoder, SpeakerEncoderConfig, load_speaker_encoder
from higgs_stream.testing import check_tensors_are_named

BOUND = 1e-5  # max over elements of |ours - reference| / |reference|, fp32 (measured 5.4e-7 on this tiny encoder)


@pytest.fixture(scope="module")
def speaker(tiny_base_dir):
    return load_speaker_encoder(tiny_base_dir)


@pytest.mark.parametrize("row", [0, 1])
def test_x_vector_matches_the_reference(speaker, ref, row):
    n = int(ref["encode_lengths"][row])
    wav = torch.from_numpy(ref["encode_pcm"][row, :n].astype(np.float32) / 32768.0)
    got = speaker.embed(wav).numpy()
    want = ref[f"speaker_embedding_{row}"]
    assert got.shape == want.shape == (16,)
    err = float((np.abs(got - want) / np.abs(want)).max())
    assert err <= BOUND, f"x-vector differs from the reference by {err:.3g} (max relative error)"


def test_the_base_codec_embeds_speakers_at_any_rate(tiny_dir, tiny_base_dir, speaker, ref):
    from higgs_stream.engine.models.registry import load_codec_for

    codec = load_codec_for(tiny_base_dir)  # the Base checkpoint: speech_tokenizer + its speaker encoder
    assert codec.embeds_speaker and codec.can_encode
    assert not load_codec_for(tiny_dir).embeds_speaker  # CustomVoice: no speaker encoder
    mono = ref["encode_pcm"][0].astype(np.float32) / 32768.0
    assert np.array_equal(codec.speaker_embedding(mono, 24000), speaker.embed(torch.from_numpy(mono)).numpy())
    stereo16 = np.stack([mono[::3], mono[1::3]])  # [2, 4000] at 8 kHz
    want = speaker.embed(torch.from_numpy(to_codec_rate(stereo16, 8000))).numpy()
    assert np.array_equal(codec.speaker_embedding(stereo16, 8000), want)
    assert codec.speaker_embedding(stereo16, 8000).dtype == np.float32


def test_loading_names_a_wrong_tensor_or_config(tmp_path, tiny_base_dir):
    root = tmp_path / "b"
    shutil.copytree(tiny_base_dir, root)
    check_tensors_are_named(root / "model.safetensors", lambda: load_speaker_encoder(root),
                            "speaker_encoder.blocks.1.se_block.conv2.weight", "speaker_encoder.extra",
                            "speaker_encoder.fc.weight", (3, 3, 1))
    raw = json.loads((root / "config.json").read_text())
    raw["speaker_encoder_config"]["enc_dim"] = 8
    (root / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="enc_dim 8 != talker hidden_size 16"):
        load_speaker_encoder(root)


def test_the_released_shape():
    with torch.device("meta"):
        full = SpeakerEncoder(SpeakerEncoderConfig(enc_dim=2048))
    shapes = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    assert shapes["blocks.0.conv.weight"] == (512, 128, 5) and shapes["mfa.conv.weight"] == (1536, 1536, 1)
    assert shapes["blocks.3.res2net_block.blocks.6.conv.weight"] == (64, 64, 3) and "blocks.4.tdnn1.conv.weight" not in shapes
    assert shapes["asp.tdnn.conv.weight"] == (128, 4608, 1) and shapes["fc.weight"] == (2048, 3072, 1)
