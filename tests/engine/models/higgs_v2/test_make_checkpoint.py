"""make-checkpoint: real on-disk layouts (pinned to the transformers classes), determinism by seed,
and the full preset's config and shape plan (its weights are never written in tests)."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from higgs_stream.engine.checkpoint_files import INDEX_FILE
from higgs_stream.engine.checkpoint_writer import add_arguments, random_tensor, shard_layout
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.models.higgs_v2.checkpoint import expected_shapes, to_layout_key
from higgs_stream.engine.models.higgs_v2.config import SpecialTokens, TalkerConfig
from higgs_stream.engine.models.higgs_v2.make_checkpoint import (
    _PRESETS,
    hf_config_dict,
    make_checkpoint,
    original_config_dict,
    talker_config,
    tensor_plan,
)
from higgs_stream.engine.models.registry import family_named

# The released checkpoint (research/higgs_v2_reference.md §1.8: index total_size, 3 shards).
RELEASED_TOTAL_BYTES = 11_542_566_912


def _digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mk")
    return {
        "hf": make_checkpoint(root / "hf", "tiny", "hf", seed=0, codec=False),
        "hf_again": make_checkpoint(root / "hf_again", "tiny", "hf", seed=0, codec=False),
        "hf_seed1": make_checkpoint(root / "hf_seed1", "tiny", "hf", seed=1, codec=False),
        "original": make_checkpoint(root / "original", "tiny", "original", seed=0, codec=False),
    }


def test_same_seed_same_bytes(written: dict[str, Path]) -> None:
    a, b = _digest(written["hf"]), _digest(written["hf_again"])
    assert a == b
    assert "model.safetensors.index.json" in a and "model-00001-of-00004.safetensors" in a


def test_other_seed_other_weights_same_files(written: dict[str, Path]) -> None:
    a, c = _tensors(written["hf"]), _tensors(written["hf_seed1"])
    assert a.keys() == c.keys()
    for key in a:
        assert not torch.equal(a[key], c[key]), key
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (written["hf"] / name).read_bytes() == (written["hf_seed1"] / name).read_bytes()


def test_layouts_hold_the_same_tensors(written: dict[str, Path]) -> None:
    hf, orig = _tensors(written["hf"]), _tensors(written["original"])
    assert len(hf) == len(orig) == 33
    for key, t in hf.items():
        assert torch.equal(orig[to_layout_key(key, "original")], t), key
    assert "audio_decoder_proj.audio_lm_head.weight" in orig and "layers.1.audio_mlp.up_proj.weight" in orig
    assert "audio_codebook_embeddings.weight" in orig and "norm.weight" in orig


def test_index_matches_files(written: dict[str, Path]) -> None:
    for layout in ("hf", "original"):
        d = written[layout]
        index = json.loads((d / INDEX_FILE).read_text())
        tensors = _tensors(d)
        assert set(index["weight_map"]) == set(tensors)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
        for key, name in index["weight_map"].items():
            with safe_open(d / name, framework="pt") as h:
                assert key in h.keys()


def test_random_values(written: dict[str, Path]) -> None:
    t = _tensors(written["hf"])
    w = t["model.layers.0.self_attn.q_proj.weight"]
    assert w.dtype == torch.float32 and abs(w.std().item() - 0.1) < 0.01 and abs(w.mean().item()) < 0.01
    norm, audio_norm = t["model.layers.0.input_layernorm.weight"], t["model.layers.0.audio_input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.05 and 0.05 < norm.std().item() < 0.15
    assert not torch.equal(norm, audio_norm)
    # One tensor's value depends only on (seed, name), not on layout or neighbours.
    assert torch.equal(w, random_tensor("model.layers.0.self_attn.q_proj.weight", (64, 64), 0, 0.1, torch.float32))


def test_tiny_plan_equals_transformers_and_our_talker(written: dict[str, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    config = json.loads((written["hf"] / "config.json").read_text())
    hf_cfg = transformers.HiggsAudioV2Config.from_pretrained(str(written["hf"]))
    for key, value in config.items():
        if key not in ("architectures", "dtype", "transformers_version"):
            assert getattr(hf_cfg, key) == value, key
    with torch.device("meta"):
        ref = transformers.HiggsAudioV2ForConditionalGeneration(hf_cfg, use_text_head=True)
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    plan = tensor_plan(talker_config("tiny"))
    assert [k for k, _ in plan] == list(ref_shapes)  # same keys, same order as save_pretrained
    assert dict(plan) == ref_shapes == expected_shapes(talker_config("tiny"))


def test_transformers_loads_the_hf_checkpoint(written: dict[str, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.HiggsAudioV2ForConditionalGeneration.from_pretrained(
        str(written["hf"]), use_text_head=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    files = _tensors(written["hf"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, files[key]), key


def test_single_file_when_it_fits(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "one", "tiny", "original", seed=0, codec=False, shard_bytes=10**9)
    assert (d / "model.safetensors").is_file() and not (d / INDEX_FILE).exists()
    assert len(_tensors(d)) == 33


def test_full_preset_plan_is_the_released_model() -> None:
    cfg = talker_config("full")
    assert cfg == TalkerConfig.full(rope_scaling=cfg.rope_scaling)
    assert cfg.special == SpecialTokens.llama3_layout()
    plan = tensor_plan(cfg)
    assert len(plan) == 397
    assert sum(2 * torch.Size(s).numel() for _, s in plan) == RELEASED_TOTAL_BYTES
    shapes = {to_layout_key(k, "original"): s for k, s in plan}
    assert shapes["embed_tokens.weight"] == (128256, 3072)
    assert shapes["layers.27.self_attn.k_proj.weight"] == (1024, 3072)
    assert shapes["layers.0.audio_mlp.down_proj.weight"] == (3072, 8192)
    assert shapes["audio_codebook_embeddings.weight"] == (8208, 3072)
    assert shapes["audio_decoder_proj.audio_lm_head.weight"] == (8208, 3072)
    assert shapes["audio_decoder_proj.text_lm_head.weight"] == (128256, 3072)
    shards = shard_layout([2 * torch.Size(s).numel() for _, s in plan], _PRESETS["full"].shard_bytes)
    assert shards[-1] + 1 == 3  # model-0000{1,2,3}-of-00003.safetensors as released


def test_full_preset_configs() -> None:
    transformers = pytest.importorskip("transformers")
    cfg, preset = talker_config("full"), _PRESETS["full"]
    hf = hf_config_dict(cfg, preset)
    # What the conversion script writes: HiggsAudioV2Config(codebook_size=1026).
    reference = transformers.HiggsAudioV2Config(codebook_size=1026).to_dict()
    for key, value in hf.items():
        if key not in ("architectures", "dtype", "transformers_version"):
            assert reference[key] == value, key
    assert hf["dtype"] == "bfloat16"
    orig = original_config_dict(cfg, preset)
    released = {  # research/higgs_v2_reference.md §1.2 (released config.json)
        "audio_adapter_type": "dual_ffn_fast_forward", "audio_dual_ffn_layers": list(range(28)),
        "audio_codebook_size": 1024, "audio_num_codebooks": 8, "audio_in_token_idx": 128015,
        "audio_out_token_idx": 128016, "audio_out_bos_token_id": 128013, "audio_eos_token_id": 128012,
        "pad_token_id": 128001, "encode_audio_in_tokens": True, "skip_audio_tower": True,
        "use_delay_pattern": True, "hidden_size": 3072, "model_type": "higgs_audio",
    }
    assert {k: orig[k] for k in released} == released
    text = orig["text_config"]
    assert (text["vocab_size"], text["num_hidden_layers"], text["num_key_value_heads"], text["rope_theta"],
            text["max_position_embeddings"], text["bos_token_id"]) == (128256, 28, 8, 500000.0, 131072, 128000)
    assert TalkerConfig.from_original_dict(orig).with_special(cfg.special) == cfg
    from_hf = TalkerConfig.from_hf_dict(hf).with_special(cfg.special)
    assert from_hf == TalkerConfig.full(rope_scaling=from_hf.rope_scaling, max_position_embeddings=2048)


def test_shard_layout() -> None:
    assert shard_layout([3, 3, 3, 10, 1, 1], limit=6) == [0, 0, 1, 2, 3, 3]
    assert shard_layout([1, 2, 3], limit=100) == [0, 0, 0]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="preset"):
        make_checkpoint(tmp_path / "a", preset="huge")
    with pytest.raises(ConfigError, match="layout"):
        make_checkpoint(tmp_path / "b", layout="gguf")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("")
    with pytest.raises(ConfigError, match="not an empty directory"):
        make_checkpoint(tmp_path / "c", codec=False)
    with pytest.raises(ConfigError, match="seed"):
        make_checkpoint(tmp_path / "d", seed=-1, codec=False)


def test_cli_arguments() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["/tmp/out", "--preset", "full", "--layout", "original", "--seed", "7"])
    assert (str(args.out), args.preset, args.layout, args.seed) == ("/tmp/out", "full", "original", 7)
    args = parser.parse_args(["out"])  # no --layout: the family's first (v2, the default arch: hf)
    assert (args.arch, args.preset, args.layout or family_named(args.arch).layouts[0], args.seed) == ("v2", "tiny", "hf", 0)
    with pytest.raises(SystemExit):
        parser.parse_args(["out", "--layout", "gguf"])


def test_fixture_checkpoints_include_the_codec(tiny_ckpt: Path, tiny_ckpt_original: Path) -> None:
    for d, layout in ((tiny_ckpt, "hf"), (tiny_ckpt_original, "original")):
        assert (d / "audio_tokenizer").is_dir() and any((d / "audio_tokenizer").iterdir())
        model_type = json.loads((d / "config.json").read_text())["model_type"]
        assert model_type == {"hf": "higgs_audio_v2", "original": "higgs_audio"}[layout]
