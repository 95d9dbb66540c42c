"""Checkpoint loading: both layouts, sharded and single-file, hub ids, and every failure mode."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import filter_repo_objects
from safetensors import safe_open
from safetensors.torch import save_file

from higgs_stream.engine import checkpoint_files as ckpt_mod
from higgs_stream.engine.batch import StepBatch
from higgs_stream.engine.checkpoint_files import (
    INDEX_FILE,
    TALKER_ALLOW_PATTERNS,
    parameters_on_meta,
    resolve_model_dir,
)
from higgs_stream.engine.errors import CheckpointError, InvalidInputError
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.models.higgs_v2.checkpoint import (
    find_codec_dir,
    load_talker,
    open_checkpoint,
    to_layout_key,
    to_native_key,
)
from higgs_stream.engine.models.higgs_v2.make_checkpoint import make_checkpoint, special_ids
from higgs_stream.engine.models.higgs_v2.talker import Talker

HUB_ID = "bosonai/higgs-audio-v2-generation-3B-base"


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Talker-only tiny checkpoints (no codec) to copy and break."""
    root = tmp_path_factory.mktemp("plain")
    return {layout: make_checkpoint(root / layout, "tiny", layout, seed=0, codec=False) for layout in ("hf", "original")}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _read_all(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _as_single_file(d: Path, edit=None) -> Path:
    """Rewrite d's weights as one model.safetensors, after `edit(tensors)`."""
    tensors = _read_all(d)
    if edit is not None:
        edit(tensors)
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / INDEX_FILE).unlink(missing_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    return d


def _edit_config(d: Path, **changes) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _step(talker: Talker, tok, seed: int = 0, want_text: bool = True):
    """One prefill step (text prompt + 6 audio columns) -> (audio logits, text logits)."""
    cfg = talker.cfg
    s = tok.special
    text = [s.begin_of_text, *tok.encode("Hello, world. How are you?"), s.audio_out_bos]
    n_text, n_audio = len(text), 6
    n = n_text + n_audio
    g = torch.Generator().manual_seed(seed)
    codes = torch.zeros(n, cfg.num_codebooks, dtype=torch.long)
    codes[n_text:] = torch.randint(0, cfg.audio_vocab, (n_audio, cfg.num_codebooks), generator=g)
    cache = KVCache.create(cfg, num_pages=4, page_size=16)
    cache.allocator.reserve(0, n)
    batch = StepBatch(
        seq_ids=[0], qo_lens=[n], input_ids=torch.tensor(text + [0] * n_audio), audio_codes=codes,
        is_audio=torch.tensor([False] * n_text + [True] * n_audio), positions=torch.arange(n),
        want_text=torch.tensor([want_text]), want_audio=torch.tensor([True]),
    )
    out = talker(batch, cache)
    return out.audio_logits, out.text_logits


# ------------------------------------------------------------------------ happy paths
def test_key_table_round_trips() -> None:
    pairs = {
        "model.embed_tokens.weight": "embed_tokens.weight",
        "model.layers.3.audio_mlp.gate_proj.weight": "layers.3.audio_mlp.gate_proj.weight",
        "model.norm.weight": "norm.weight",
        "model.embed_audio_tokens.embed_audio_tokens.weight": "audio_codebook_embeddings.weight",
        "audio_lm_head.weight": "audio_decoder_proj.audio_lm_head.weight",
        "text_lm_head.weight": "audio_decoder_proj.text_lm_head.weight",
    }
    for native, original in pairs.items():
        assert to_layout_key(native, "original") == original
        assert to_native_key(original, "original") == native
        assert to_layout_key(native, "hf") == to_native_key(native, "hf") == native
    assert to_native_key("lm_head.weight", "hf") is None
    assert to_native_key("model.norm.weight", "original") is None


def test_both_layouts_load_identical_talkers(tiny_ckpt: Path, tiny_ckpt_original: Path) -> None:
    a, cfg_a, tok_a = load_talker(tiny_ckpt)
    b, cfg_b, tok_b = load_talker(tiny_ckpt_original)
    assert isinstance(a, Talker) and not a.training
    assert cfg_a.special == cfg_b.special == tok_a.special == special_ids(512)
    # The layouts spell llama3 RoPE differently (hf: 0.125/0.5/1024, original: 1/4/8192) but
    # describe the same frequencies; everything else in the configs is equal.
    assert cfg_a.rope_scaling["original_max_position_embeddings"] == 1024
    assert cfg_b.rope_scaling["original_max_position_embeddings"] == 8192
    assert torch.equal(a.inv_freq, b.inv_freq)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and len(sa) == 33
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    audio_a, text_a = _step(a, tok_a)
    audio_b, text_b = _step(b, tok_b)
    assert audio_a.shape == (1, 8, 1026) and text_a.shape == (1, 768)
    assert torch.isfinite(audio_a).all() and audio_a.std() > 0.05
    assert torch.equal(audio_a, audio_b) and torch.equal(text_a, text_b)


def test_loaded_weights_are_the_file_tensors(tiny_ckpt_original: Path) -> None:
    talker, _, _ = load_talker(tiny_ckpt_original)
    files = _read_all(tiny_ckpt_original)
    state = talker.state_dict()
    assert len(files) == len(state)
    for key, value in state.items():
        assert torch.equal(value, files[to_layout_key(key, "original")]), key
    assert all(not p.requires_grad and p.device.type == "cpu" for p in talker.parameters())
    assert torch.equal(talker.model.embed_audio_tokens.offsets, torch.arange(8) * 1026)


def test_dtype_cast_on_load(plain: dict[str, Path]) -> None:
    f32, _, tok = load_talker(plain["hf"])
    bf16, _, _ = load_talker(plain["hf"], dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.inv_freq.dtype == torch.float32  # derived buffers keep their own dtype
    for (k, p32), (_, p16) in zip(f32.state_dict().items(), bf16.state_dict().items()):
        assert torch.equal(p32.to(torch.bfloat16), p16), k
    a32, _ = _step(f32, tok)
    a16, _ = _step(bf16, tok)
    assert (a32 - a16).abs().max() < 0.1 * a32.abs().max()


def test_single_file_checkpoints_load(plain: dict[str, Path], tmp_path: Path) -> None:
    ref = load_talker(plain["hf"])[0].state_dict()
    for layout in ("hf", "original"):
        d = _as_single_file(_copy(plain[layout], tmp_path / layout))
        assert not (d / INDEX_FILE).exists()
        loaded = load_talker(d)[0].state_dict()
        assert all(torch.equal(loaded[k], ref[k]) for k in ref)


def test_known_non_weight_keys_are_skipped(plain: dict[str, Path], tmp_path: Path) -> None:
    d = _as_single_file(_copy(plain["original"], tmp_path / "o"),
                        lambda t: t.update({"layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    assert open_checkpoint(d).layout == "original"


def test_parameters_on_meta_keeps_buffers_real() -> None:
    from higgs_stream.engine.models.higgs_v2.make_checkpoint import talker_config

    with parameters_on_meta():
        talker = Talker(talker_config("tiny"))
    assert all(p.device.type == "meta" for p in talker.parameters())
    assert talker.inv_freq.device.type == "cpu" and torch.isfinite(talker.inv_freq).all()
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone afterwards


# ------------------------------------------------------------------------ model dir / hub
def test_resolve_local_dir(plain: dict[str, Path], tmp_path: Path) -> None:
    assert resolve_model_dir(str(plain["hf"])) == plain["hf"].resolve()
    with pytest.raises(CheckpointError, match="neither an existing directory nor a hub id"):
        resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match="neither an existing directory nor a hub id"):
        resolve_model_dir("a/b/c")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve_model_dir(str(tmp_path / "file"))


def test_hub_id_goes_through_snapshot_download(plain, tiny_ckpt: Path, monkeypatch) -> None:
    calls = []

    def fake_snapshot_download(repo_id, *, revision=None, allow_patterns=None, **kwargs):
        calls.append((repo_id, revision, allow_patterns, kwargs))
        return str(tiny_ckpt)

    monkeypatch.setattr(ckpt_mod, "snapshot_download", fake_snapshot_download)
    talker, cfg, tok = load_talker(HUB_ID)
    assert len(calls) == 1
    repo_id, revision, patterns, kwargs = calls[0]
    assert (repo_id, revision, kwargs) == (HUB_ID, None, {})  # no tqdm_class override: progress bar on
    assert patterns == list(TALKER_ALLOW_PATTERNS)
    # The patterns select the talker files of a real checkpoint dir and nothing of the codec.
    files = sorted(str(p.relative_to(tiny_ckpt)) for p in tiny_ckpt.rglob("*") if p.is_file())
    chosen = set(filter_repo_objects(files, allow_patterns=patterns))
    assert chosen == {f for f in files if not f.startswith("audio_tokenizer/")}
    assert "model.safetensors" in set(filter_repo_objects(["model.safetensors"], allow_patterns=patterns))
    assert cfg == load_talker(tiny_ckpt)[1]


def test_hub_failures_raise_checkpoint_error(monkeypatch, tmp_path: Path) -> None:
    def offline(repo_id, **kwargs):
        raise LocalEntryNotFoundError("no connection and not cached")

    monkeypatch.setattr(ckpt_mod, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match=r"cannot download 'bosonai/x' .*offline"):
        resolve_model_dir("bosonai/x")

    def bad_id(repo_id, **kwargs):
        raise HFValidationError("bad repo id")

    monkeypatch.setattr(ckpt_mod, "snapshot_download", bad_id)
    with pytest.raises(CheckpointError, match="invalid hub id"):
        resolve_model_dir("bosonai/x y")

    empty = tmp_path / "snapshot"
    empty.mkdir()
    monkeypatch.setattr(ckpt_mod, "snapshot_download", lambda repo_id, **kw: str(empty))
    with pytest.raises(CheckpointError, match="has no config.json"):
        resolve_model_dir("bosonai/not-a-talker")


def test_real_snapshot_download_offline(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CheckpointError, match="offline"):
        resolve_model_dir(HUB_ID)


def test_find_codec_dir(tiny_ckpt: Path, plain: dict[str, Path]) -> None:
    assert find_codec_dir(tiny_ckpt) == tiny_ckpt / "audio_tokenizer"
    assert find_codec_dir(str(plain["hf"])) == "bosonai/higgs-audio-v2-tokenizer"  # no bundled codec
    assert find_codec_dir(HUB_ID) == "bosonai/higgs-audio-v2-tokenizer"


# ------------------------------------------------------------------------------ failures
@pytest.mark.parametrize("layout,stored", [
    ("hf", "model.layers.1.audio_mlp.down_proj.weight"),
    ("hf", "audio_lm_head.weight"),
    ("original", "audio_decoder_proj.audio_lm_head.weight"),
    ("original", "layers.0.audio_post_attention_layernorm.weight"),
])
def test_missing_key_is_named(plain, tmp_path: Path, layout: str, stored: str) -> None:
    d = _as_single_file(_copy(plain[layout], tmp_path / "c"), lambda t: t.pop(stored))
    with pytest.raises(CheckpointError, match=f"missing key {re.escape(stored)} in the {layout}"):
        load_talker(d)


@pytest.mark.parametrize("layout,stored", [
    ("hf", "text_lm_head.weight"),
    ("original", "audio_decoder_proj.text_lm_head.weight"),
])
def test_text_head_is_optional(plain, tmp_path: Path, layout: str, stored: str) -> None:
    """transformers saves no text head by default (`use_text_head=False`): such a talker loads,
    computes the same audio logits, and refuses only an explicit request for text logits."""
    full, _, tok = load_talker(plain[layout])
    d = _as_single_file(_copy(plain[layout], tmp_path / "c"), lambda t: t.pop(stored))
    headless, _, _ = load_talker(d)
    assert full.text_lm_head is not None and headless.text_lm_head is None
    with pytest.raises(InvalidInputError, match="without a text head"):
        _step(headless, tok)
    audio_full, _ = _step(full, tok, want_text=False)
    audio_headless, text = _step(headless, tok, want_text=False)
    assert text is None and torch.equal(audio_headless, audio_full)


@pytest.mark.parametrize("layout,stored,detail", [
    ("hf", "lm_head.weight", ""),
    ("hf", "model.layers.0.extra.weight", ""),
    ("original", "layers.0.extra.weight", "maps to model.layers.0.extra.weight"),
    ("original", "model.norm.weight", ""),  # an hf-named key inside an original checkpoint
    ("original", "embed_tokens.embedding_frozen.weight", "must be merged first"),
])
def test_unexpected_key_is_named(plain, tmp_path: Path, layout: str, stored: str, detail: str) -> None:
    d = _as_single_file(_copy(plain[layout], tmp_path / "c"), lambda t: t.update({stored: torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=f"unexpected key {stored} in model.safetensors") as e:
        load_talker(d)
    assert detail in str(e.value)


@pytest.mark.parametrize("layout,stored,shape,expected", [
    ("hf", "model.embed_tokens.weight", (767, 64), [768, 64]),
    ("original", "layers.1.self_attn.k_proj.weight", (64, 64), [32, 64]),
    ("original", "audio_decoder_proj.audio_lm_head.weight", (8192, 64), [8208, 64]),
])
def test_shape_mismatch_names_key_expected_got(plain, tmp_path: Path, layout, stored, shape, expected) -> None:
    d = _as_single_file(_copy(plain[layout], tmp_path / "c"), lambda t: t.update({stored: torch.zeros(shape)}))
    with pytest.raises(CheckpointError) as e:
        load_talker(d)
    assert str(e.value) == f"shape mismatch for {stored}: expected {expected}, got {list(shape)}"


def test_unknown_model_type_and_architecture(plain, tmp_path: Path) -> None:
    d = _edit_config(_copy(plain["hf"], tmp_path / "a"), model_type="llama")
    with pytest.raises(CheckpointError, match="unknown model_type 'llama'"):
        load_talker(d)
    d = _edit_config(_copy(plain["hf"], tmp_path / "b"), architectures=["HiggsAudioV2Model"])
    with pytest.raises(CheckpointError, match=r"unknown architecture \['HiggsAudioV2Model'\]"):
        load_talker(d)
    d = _edit_config(_copy(plain["original"], tmp_path / "c"), architectures=["HiggsAudioV2ForConditionalGeneration"])
    with pytest.raises(CheckpointError, match="unknown architecture"):
        load_talker(d)


def test_invalid_config_values_become_checkpoint_errors(plain, tmp_path: Path) -> None:
    d = _edit_config(_copy(plain["hf"], tmp_path / "a"), codebook_size=1024)  # real codes, not rows
    with pytest.raises(CheckpointError, match="codebook_size"):
        load_talker(d)
    d = _edit_config(_copy(plain["original"], tmp_path / "b"), audio_dual_ffn_layers=[0])
    with pytest.raises(CheckpointError, match="DualFFN"):
        load_talker(d)
    d = _copy(plain["hf"], tmp_path / "c")
    (d / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_talker(d)


def test_config_ids_must_match_tokenizer(plain, tmp_path: Path) -> None:
    d = _edit_config(_copy(plain["hf"], tmp_path / "a"), audio_token_id=527)
    with pytest.raises(CheckpointError, match="audio_token_id=527 but the tokenizer gives id 528"):
        load_talker(d)
    d = _edit_config(_copy(plain["original"], tmp_path / "b"), audio_out_bos_token_id=1)
    with pytest.raises(CheckpointError, match="audio_out_bos_token_id=1"):
        load_talker(d)
    d = _edit_config(_copy(plain["hf"], tmp_path / "c"), vocab_size=600)
    with pytest.raises(CheckpointError, match="tokenizer has 768 ids but the talker's text vocab_size is 600"):
        load_talker(d)


def test_missing_files(plain, tmp_path: Path) -> None:
    d = _copy(plain["hf"], tmp_path / "a")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_talker(d)
    d = _copy(plain["original"], tmp_path / "b")
    (d / "model-00002-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing shard file model-00002-of-00004.safetensors"):
        load_talker(d)
    d = _copy(plain["hf"], tmp_path / "c")
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="missing tokenizer.json"):
        load_talker(d)
    d = _copy(plain["hf"], tmp_path / "d")
    for f in [*d.glob("*.safetensors"), d / INDEX_FILE]:
        f.unlink()
    torch.save({}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model.safetensors or model.safetensors.index.json .*pytorch_model.bin"):
        load_talker(d)


def test_index_inconsistent_with_shards(plain, tmp_path: Path) -> None:
    d = _copy(plain["hf"], tmp_path / "a")
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00004-of-00004.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists tensor model.norm.weight in model-00004-of-00004.safetensors, but it is in"):
        load_talker(d)
    d = _copy(plain["hf"], tmp_path / "b")
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00004.safetensors"
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lists tensor model.extra.weight .* no shard contains it"):
        load_talker(d)


def test_corrupt_and_non_float_tensors(plain, tmp_path: Path) -> None:
    d = _copy(plain["hf"], tmp_path / "a")
    (d / "model-00003-of-00004.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="cannot read safetensors header of .*model-00003-of-00004"):
        load_talker(d)
    d = _as_single_file(_copy(plain["hf"], tmp_path / "b"),
                        lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match="model.norm.weight has unsupported dtype I32"):
        load_talker(d)


def _set(path: str, value):
    """An edit of config.json setting the dotted `path` (e.g. "text_config.num_hidden_layers")."""
    def edit(cfg: dict) -> None:
        *parents, key = path.split(".")
        for p in parents:
            cfg = cfg[p]
        cfg[key] = value
    return edit


@pytest.mark.parametrize("layout,path,value,match", [
    # an absurd layer count fails on the header check, before one module per layer is built
    ("hf", "num_hidden_layers", 10**9, r"num_hidden_layers is 1000000000, but the weight files hold 2 layers"),
    ("original", "text_config.num_hidden_layers", 10**7, r"only all-DualFFN .* for num_hidden_layers=10000000"),
    ("original", "audio_dual_ffn_layers", [0, 1, 2],
     r"text_config.num_hidden_layers is 3, but the weight files hold 2 layers \(layers.0..1\)"),
    # wrongly typed fields: named, never coerced
    ("hf", "hidden_size", "64", "hidden_size must be an int, got '64'"),
    ("hf", "hidden_size", 64.5, "hidden_size must be an int, got 64.5"),
    ("hf", "hidden_size", True, "hidden_size must be an int, got True"),
    ("hf", "num_hidden_layers", "2", "num_hidden_layers must be an int, got '2'"),
    ("hf", "codebook_size", [1], r"codebook_size must be an int, got \[1\]"),
    ("hf", "num_codebooks", "x", "num_codebooks must be an int"),
    ("hf", "audio_stream_bos_id", "x", "audio_stream_bos_id must be an int"),
    ("hf", "max_position_embeddings", [1], "max_position_embeddings must be an int"),
    ("hf", "rms_norm_eps", "x", "rms_norm_eps must be a number, got 'x'"),
    ("hf", "rope_parameters.rope_theta", "x", "rope_parameters.rope_theta must be a number, got 'x'"),
    ("original", "text_config", "x", "text_config must be a JSON object, got 'x'"),
    ("original", "text_config.hidden_size", "64", "text_config.hidden_size must be an int"),
])
def test_bad_config_fields_fail_fast_naming_file_and_field(plain, tmp_path: Path, layout, path, value, match) -> None:
    d = _copy(plain[layout], tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    _set(path, value)(cfg)
    if path == "audio_dual_ffn_layers":  # a consistent original config claiming a third layer the files lack
        cfg["text_config"]["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=re.escape(str(d / "config.json")) + ": " + match) as e:
        load_talker(d)
    assert e.value.code == "checkpoint"
