"""The Qwen3-TTS family through the registry: chosen by model_type, make-checkpoint --arch qwen3-tts in the
hub layout (loads back, decodes), device rules for the fast path, typed errors for a wrong
checkpoint, the presets' shapes."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from higgs_stream.engine.checkpoint_writer import write_checkpoint
from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.models.qwen3_tts.checkpoint import load_model
from higgs_stream.engine.models.qwen3_tts.config import preset
from higgs_stream.engine.models.qwen3_tts.generate import generate_frames
from higgs_stream.engine.models.qwen3_tts.prompt import build_prompt
from higgs_stream.engine.models.registry import family_named, load_codec_for, model_arch
from higgs_stream.testing import check_tensors_are_named
from safetensors.torch import load_file, save_file


def test_the_registry_knows_the_fixture_checkpoint(tiny_dir):
    assert model_arch(tiny_dir) == "qwen3-tts"
    codec = load_codec_for(tiny_dir)
    assert codec.geometry.num_codebooks == 16 and codec.geometry.causal


def test_make_checkpoint_writes_a_loadable_hub_layout(tmp_path):
    out = write_checkpoint(tmp_path / "q", arch="qwen3-tts", preset="tiny", seed=3)
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                              "speech_tokenizer", "vocab.json", "merges.txt", "tokenizer_config.json"}
    model = load_model(out)
    cfg = model.cfg
    assert cfg == preset("tiny") and cfg.variant == "custom_voice"
    text = [cfg.im_start_id, 11, 13, 40, 41, 42, cfg.im_end_id, 13, cfg.im_start_id, 11, 13]
    frames = generate_frames(model, build_prompt(cfg, text, language="english", speaker="aiden"), 4)
    assert frames.shape[1] == 16 and (frames < cfg.codebook_size).all()
    if len(frames):
        wav = load_codec_for(out).decode(torch.from_numpy(frames.T[None].copy()))
        assert wav.shape == (1, len(frames) * 1920) and torch.isfinite(wav).all()
    with pytest.raises(ConfigError, match="not an empty directory"):
        write_checkpoint(out, arch="qwen3-tts")
    with pytest.raises(ConfigError, match="unknown preset"):
        write_checkpoint(tmp_path / "x", arch="qwen3-tts", preset="huge")


def test_make_checkpoint_base_writes_the_audio_front_end(tmp_path):
    """A Base checkpoint holds speaker_encoder.* beside the talker and the encoder in speech_tokenizer/;
    the family's codec for it encodes and embeds speakers; without the encoder it does not load."""
    out = write_checkpoint(tmp_path / "b", arch="qwen3-tts", preset="tiny-base", seed=4)
    raw = json.loads((out / "config.json").read_text())
    assert raw["tts_model_type"] == "base" and raw["speaker_encoder_config"]["enc_dim"] == 16
    assert load_model(out).cfg.variant == "base"
    keys = load_file(out / "model.safetensors").keys()
    assert any(k.startswith("speaker_encoder.") for k in keys) and any(k.startswith("talker.") for k in keys)
    codec = load_codec_for(out)
    assert codec.can_encode and codec.embeds_speaker
    wav = np.sin(np.arange(12000) / 7.0).astype(np.float32) * 0.3
    codes, xvec = codec.encode(wav, 24000), codec.speaker_embedding(wav, 24000)
    assert codes.shape == (16, 7) and (codes < 64).all() and xvec.shape == (16,) and np.isfinite(xvec).all()
    st = load_file(out / "speech_tokenizer" / "model.safetensors")
    save_file({k: v for k, v in st.items() if not k.startswith("encoder.")}, out / "speech_tokenizer" / "model.safetensors")
    with pytest.raises(CheckpointError, match="needs the 12 Hz tokenizer's encoder"):
        load_codec_for(out)
    custom = write_checkpoint(tmp_path / "c", arch="qwen3-tts", preset="tiny", seed=4)
    assert not load_codec_for(custom).can_encode  # the other variants' tokenizer: decoder only
    design = write_checkpoint(tmp_path / "d", arch="qwen3-tts", preset="tiny-design", seed=4)
    assert load_model(design).cfg.variant == "voice_design"


def test_the_released_encoder_shapes():
    from higgs_stream.engine.models.qwen3_tts.codec import FULL, QwenCodec
    from higgs_stream.engine.models.qwen3_tts.make_checkpoint import FULL_ENCODER

    with torch.device("meta"):
        codec = QwenCodec(replace(FULL, encoder=FULL_ENCODER.to_json()), with_encoder=True)
    shapes = {k: tuple(v.shape) for k, v in codec.encoder.state_dict().items()}
    assert shapes["encoder.layers.0.conv.weight"] == (64, 1, 7) and shapes["encoder.layers.14.conv.weight"] == (512, 1024, 3)
    assert shapes["downsample.conv.weight"] == (512, 512, 4)
    q = "quantizer.acoustic_residual_vector_quantizer"
    assert shapes[f"{q}.input_proj.weight"] == (256, 512, 1) and shapes[f"{q}.layers.30.codebook.embed_sum"] == (2048, 256)
    assert codec.encoder.cfg.hop == 1920 and codec.encoder.num_codebooks == 16


def test_the_family_has_device_rules_for_the_fast_path(tiny_dir):
    from higgs_stream.engine.models.qwen3_tts.device_rules import QwenDeviceRules

    family = family_named("qwen3-tts")
    assert family.policy(preset("tiny"), None).head_codebooks == 1  # the code predictor completes each frame
    assert isinstance(family.device_rules(preset("tiny")), QwenDeviceRules)


def test_a_wrong_checkpoint_names_the_key(tmp_path, tiny_dir):
    root = tmp_path / "c"
    shutil.copytree(tiny_dir, root)
    check_tensors_are_named(root / "model.safetensors", lambda: load_model(root), "talker.code_predictor.lm_head.14.weight",
                            "talker.extra", "talker.codec_head.weight", (3, 3))
    raw = json.loads((tiny_dir / "config.json").read_text())
    del raw["talker_config"]["codec_bos_id"]
    (root / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="codec_bos_id"):
        load_model(root)


def test_presets_have_the_released_shapes():
    small, large = preset("0.6b"), preset("1.7b")
    assert (small.hidden_size, small.num_layers, small.vocab_size, small.codebook_size) == (1024, 28, 3072, 2048)
    assert (large.hidden_size, large.intermediate_size) == (2048, 6144)
    assert large.code_predictor.hidden_size == 1024 and large.code_predictor.num_layers == 5
    assert len(preset("0.6b").speakers) == 9 and preset("0.6b", "base").speakers == {}
    with torch.device("meta"):
        from higgs_stream.engine.models.qwen3_tts.talker import QwenTTSModel

        n = sum(p.numel() for p in QwenTTSModel(large).parameters())
    assert 1.5e9 < n < 2.1e9, n
    assert np.isfinite(n)
