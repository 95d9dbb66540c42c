"""v3 checkpoint: config parsing, the writer's on-disk layout, the loader and its typed errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from higgs_stream.engine.checkpoint_writer import random_tensor
from higgs_stream.engine.codec.config import CodecConfig
from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.models.higgs_v3.checkpoint import (
    AUDIO_MATRIX,
    CODEC_CONFIG_KEY,
    CODEC_PREFIX,
    TEXT_EMBEDDING,
    is_v3_checkpoint,
    load_codec_v3,
    load_talker_v3,
    talker_key_shapes,
)
from higgs_stream.engine.models.higgs_v3.config import TalkerV3Config, V3SpecialTokens
from higgs_stream.engine.models.higgs_v3.make_checkpoint import build_v3_tokenizer, make_checkpoint_v3, preset_v3


@pytest.fixture(scope="module")
def ckpt(tiny_v3_ckpt) -> Path:
    return tiny_v3_ckpt  # make_checkpoint_v3(DIR, preset="tiny", seed=0), session-wide


def all_tensors(root: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(root.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ------------------------------------------------------------------------------------ config
def test_config_round_trip_and_real_values():
    full = TalkerV3Config.full()
    d = full.to_hf_dict()
    assert d["model_type"] == "higgs_multimodal_qwen3" and d["audio_token_id"] == -100
    assert d["text_config"]["rope_parameters"]["rope_theta"] == 1_000_000
    assert d["audio_encoder_config"] == {"encoder_type": "discrete", "num_codebooks": 8, "vocab_size": 1026,
                                         "out_dim": 2560, "use_delay_pattern": True, "tie_word_embeddings": True}
    back = TalkerV3Config.from_hf_dict(d)
    assert back == TalkerV3Config.full(special=None)
    assert (back.hidden_size, back.num_layers, back.num_heads, back.num_kv_heads, back.head_dim, back.vocab_size,
            back.intermediate_size, back.rms_norm_eps) == (2560, 36, 32, 8, 128, 151936, 9728, 1e-6)
    assert back.audio_vocab == 1026 and back.codebook_size == 1024


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(model_type="higgs_audio_v2"), "model_type"),
    (lambda d: d["text_config"].pop("rope_parameters"), "rope_theta"),
    (lambda d: d["text_config"].update(tie_word_embeddings=False), "tie_word_embeddings"),
    (lambda d: d["audio_encoder_config"].update(encoder_type="whisper"), "discrete"),
    (lambda d: d["audio_encoder_config"].update(out_dim=1024), "out_dim"),
    (lambda d: d["text_config"].pop("hidden_size"), "hidden_size"),
])
def test_config_errors(edit, match):
    d = TalkerV3Config.full().to_hf_dict()
    edit(d)
    with pytest.raises(ConfigError, match=match):
        TalkerV3Config.from_hf_dict(d)


def test_legacy_flat_rope_theta_is_read():
    d = TalkerV3Config.tiny().to_hf_dict()
    d["text_config"].pop("rope_parameters")
    d["text_config"]["rope_theta"] = 5e5
    assert TalkerV3Config.from_hf_dict(d).rope_theta == 5e5


def test_null_rope_theta_is_the_qwen3_default():
    d = TalkerV3Config.tiny(rope_theta=5e5).to_hf_dict()
    d["text_config"]["rope_parameters"]["rope_theta"] = None
    assert TalkerV3Config.from_hf_dict(d).rope_theta == 1_000_000.0
    d["text_config"].pop("rope_parameters")
    d["text_config"]["rope_theta"] = None
    assert TalkerV3Config.from_hf_dict(d).rope_theta == 1_000_000.0


def test_full_preset_tokenizer_ids():
    """Qwen3 layout: <|endoftext|> 151643, <|audio_end|> 151671 (the ids peers hard-code as stops)."""
    p = preset_v3("full")
    tok = build_v3_tokenizer(p.bpe_vocab, p.added)
    special = V3SpecialTokens.from_lookup(tok.token_to_id)
    assert special == V3SpecialTokens.full_preset() == p.config.special
    assert special.stop_ids == (151643, 151671)
    assert tok.get_vocab_size(with_added_tokens=True) <= p.config.vocab_size == 151936


# ------------------------------------------------------------------------------------ writer
def test_writer_layout(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "higgs_multimodal_qwen3"
    assert CodecConfig.from_hf_dict(config[CODEC_CONFIG_KEY]) == CodecConfig.tiny()
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    cfg = TalkerV3Config.tiny()
    talker = {k for k in index if not k.startswith(CODEC_PREFIX)}
    assert talker == set(talker_key_shapes(cfg))  # nothing else outside the codec prefix
    codec = [k for k in index if k.startswith(CODEC_PREFIX)]
    assert f"{CODEC_PREFIX}quantizer.quantizers.0.codebook.embed" in codec
    assert any(k.startswith(f"{CODEC_PREFIX}semantic_model.") for k in codec)  # encoder side bundled too
    assert len(set(index.values())) > 1  # sharded, codec tensors in the same files
    with safe_open(ckpt / index[AUDIO_MATRIX], "pt") as f:
        assert f.get_slice(AUDIO_MATRIX).get_shape() == [8 * 1026, 64]
    assert is_v3_checkpoint(ckpt)


def test_writer_is_seeded(tmp_path, ckpt):
    again = make_checkpoint_v3(tmp_path / "again", preset="tiny", seed=0)
    a, b = all_tensors(ckpt), all_tensors(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(random_tensor(TEXT_EMBEDDING, (300, 64), 0, 0.1, torch.float32), a[TEXT_EMBEDDING])
    assert not torch.equal(random_tensor(TEXT_EMBEDDING, (300, 64), 1, 0.1, torch.float32), a[TEXT_EMBEDDING])
    with pytest.raises(ConfigError, match="not an empty directory"):
        make_checkpoint_v3(tmp_path / "again", preset="tiny", seed=1)


# ------------------------------------------------------------------------------------ loader
def test_load_talker_and_codec(ckpt):
    talker, cfg, tok = load_talker_v3(ckpt)
    assert cfg == TalkerV3Config.tiny() and cfg.special == tok.special
    files = all_tensors(ckpt)
    sd = talker.state_dict()
    assert sd.keys() == talker_key_shapes(cfg).keys()
    assert all(torch.equal(sd[k], files[k]) for k in sd)
    codec = load_codec_v3(ckpt)
    assert codec.can_encode and codec.cfg == CodecConfig.tiny()
    ours = codec.state_dict()
    assert torch.equal(ours["fc2.weight"], files[CODEC_PREFIX + "fc2.weight"])
    assert torch.equal(ours["quantizer.quantizers.3.codebook.embed"],
                       files[CODEC_PREFIX + "quantizer.quantizers.3.codebook.embed"])


def test_bf16_checkpoint_loads_in_the_requested_dtype(tmp_path, ckpt):
    """A bf16 checkpoint loaded as fp32 is fp32 throughout, the fused audio matrix included: a bf16
    matrix beside an fp32 backbone would sum embeddings and compute audio logits in bf16."""
    root = copy(ckpt, tmp_path)
    rewrite(root, lambda t: {k: (v.to(torch.bfloat16) if not k.startswith(CODEC_PREFIX) else v) for k, v in t.items()})
    stored = all_tensors(root)
    talker, _, _ = load_talker_v3(root, dtype=torch.float32)
    assert {n: p.dtype for n, p in talker.named_parameters() if p.dtype != torch.float32} == {}
    assert talker.dtype == torch.float32
    assert torch.equal(talker.audio.embedding.weight, stored[AUDIO_MATRIX].float())
    talker, _, _ = load_talker_v3(root)  # dtype None: as stored
    assert {p.dtype for p in talker.parameters()} == {torch.bfloat16}


def copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "ckpt"))


def rewrite(root: Path, edit) -> None:
    """Apply `edit(tensors) -> tensors` to the whole checkpoint, rewritten as one file."""
    tensors = edit(all_tensors(root))
    for f in root.glob("model*.safetensors*"):
        f.unlink()
    save_file(tensors, str(root / "model.safetensors"))


@pytest.mark.parametrize("edit,match", [
    (lambda t: {**t, "body.layers.0.mlp.extra.weight": torch.zeros(2)}, "unexpected key body.layers.0.mlp.extra.weight"),
    (lambda t: {k: v for k, v in t.items() if k != "body.layers.1.self_attn.k_norm.weight"},
     "missing key body.layers.1.self_attn.k_norm.weight"),
    (lambda t: {**t, "body.norm.weight": torch.ones(65)}, "body.norm.weight has shape"),
    (lambda t: {**t, "tied.head.text_head.weight": t[TEXT_EMBEDDING] + 1}, "untied heads"),
    (lambda t: {k: v for k, v in t.items() if not k.startswith(CODEC_PREFIX)}, "no bundled codec"),
    (lambda t: {k: v for k, v in t.items() if k != CODEC_PREFIX + "fc2.weight"}, "missing key .*fc2.weight"),
])
def test_loader_errors_name_the_key(tmp_path, ckpt, edit, match):
    root = copy(ckpt, tmp_path)
    rewrite(root, edit)
    with pytest.raises(CheckpointError, match=match):
        load_talker_v3(root)
        load_codec_v3(root)


def test_tied_copies_equal_to_their_source_are_accepted(tmp_path, ckpt):
    root = copy(ckpt, tmp_path)
    rewrite(root, lambda t: {**t, "tied.head.text_head.weight": t[TEXT_EMBEDDING].clone(),
                             "tied.head.modality_heads.0.weight": t[AUDIO_MATRIX].clone()})
    talker, _, _ = load_talker_v3(root)
    assert "tied.head.text_head.weight" not in talker.state_dict()


def test_tokenizer_and_config_mismatches(tmp_path, ckpt):
    root = copy(ckpt, tmp_path)
    config = json.loads((root / "config.json").read_text())
    config["text_config"]["eos_token_id"] = 5
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="eos_token_id"):
        load_talker_v3(root)
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<|tts|>"]
    (root / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match=r"<\|tts\|>"):
        load_talker_v3(root)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d["text_config"].update(num_hidden_layers=10**9),  # fails before the per-layer key table
     r"text_config.num_hidden_layers is 1000000000, but the weight files hold 2 layers \(body.layers.0..1\)"),
    (lambda d: d.update(text_config="x"), "text_config must be a JSON object, got 'x'"),
    (lambda d: d.pop("text_config"), "text_config is required"),
    (lambda d: d["text_config"].update(hidden_size="64"), "text_config.hidden_size must be an int, got '64'"),
    (lambda d: d["text_config"].update(rms_norm_eps="x"), "text_config.rms_norm_eps must be a number"),
    (lambda d: d["audio_encoder_config"].update(num_codebooks=[8]), "audio_encoder_config.num_codebooks must be an int"),
    (lambda d: d[CODEC_CONFIG_KEY].update(sample_rate=0), "codec config: sample_rate must be an int in"),
    (lambda d: d[CODEC_CONFIG_KEY].update(sample_rate="x"), "codec config: sample_rate must be an int, got 'x'"),
])
def test_bad_config_fields_fail_fast(tmp_path, ckpt, edit, match):
    d = shutil.copytree(ckpt, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match) as e:
        load_talker_v3(d)
        load_codec_v3(d)
    assert e.value.code == "checkpoint" and "config.json" in str(e.value)
