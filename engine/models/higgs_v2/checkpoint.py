"""Load the Higgs Audio v2 talker and its text tokenizer from a checkpoint directory or hub id.

Two on-disk layouts hold the same 397 tensors (research/higgs_v2_reference.md §1.8):

* "hf": transformers-native (`config.json` model_type "higgs_audio_v2"), what the hub repo
  `bosonai/higgs-audio-v2-generation-3B-base` holds now. Keys equal our `Talker.state_dict()`.
* "original": Boson's layout (model_type "higgs_audio", nested Llama `text_config`), keys without
  the `model.` prefix and heads under `audio_decoder_proj.`.

Either is one `model.safetensors` or shards listed by `model.safetensors.index.json`. Key names
are translated through `KEY_PREFIXES` (a table, not a conversion script). Every file header is
checked against the talker's expected keys and shapes before a byte of weight data is read; then
tensors stream shard by shard straight into a talker whose parameters start on the meta device,
so a 3B model never needs twice its memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from higgs_stream.engine.batch import DEFAULT_MAX_POSITIONS
from higgs_stream.engine.checkpoint_files import (
    CONFIG_FILE,
    TensorEntry,
    check_layer_count,
    parameters_on_meta,
    read_config_json,
    read_generation_config,
    read_headers,
    read_tensors,
    resolve_model_dir,
    swap_prefix,
    weight_files,
)
from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.models.higgs_v2.config import SpecialTokens, TalkerConfig
from higgs_stream.engine.models.higgs_v2.talker import Talker
from higgs_stream.engine.tokenizer import TextTokenizer

# config.json `model_type` -> layout, and the `architectures` entries each layout may declare.
MODEL_TYPES = {"higgs_audio_v2": "hf", "higgs_audio": "original"}
ARCHITECTURES = {"hf": ("HiggsAudioV2ForConditionalGeneration",), "original": ("HiggsAudioModel",)}

# (transformers-native prefix, prefix in the layout's files). First match wins; a file key that
# matches no row is an unexpected key. Used in both directions (make_checkpoint writes with it).
KEY_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "hf": (
        ("model.", "model."),
        ("audio_lm_head.", "audio_lm_head."),
        ("text_lm_head.", "text_lm_head."),
    ),
    "original": (
        ("model.embed_tokens.", "embed_tokens."),
        ("model.layers.", "layers."),
        ("model.norm.", "norm."),
        ("model.embed_audio_tokens.embed_audio_tokens.", "audio_codebook_embeddings."),
        ("audio_lm_head.", "audio_decoder_proj.audio_lm_head."),
        ("text_lm_head.", "audio_decoder_proj.text_lm_head."),
    ),
}

# Tensors a checkpoint may omit. transformers builds HiggsAudioV2ForConditionalGeneration with
# `use_text_head=False` by default and then saves no text head; generation never reads it (audio
# steps use `audio_lm_head` only), so the talker gets a text head exactly when the file has one
# and asking a head-less talker for text logits raises.
OPTIONAL_KEYS = frozenset({"text_lm_head.weight"})

# Non-weight tensors some writers store; they are recomputed, so they are skipped by name.
IGNORED_KEYS = re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq)$|^audio_codebook_weights$")

# Training-time split weights (REF PartiallyFrozenEmbedding/Linear); not in released checkpoints.
_SPLIT_WEIGHT = re.compile(r"\.(embedding|linear)_(frozen|trainable)\.")

# --------------------------------------------------------------------------------------- keys
def to_native_key(key: str, layout: str) -> str | None:
    """The transformers-native name of a file key, or None when no table row matches."""
    return swap_prefix(key, ((stored, native) for native, stored in KEY_PREFIXES[layout]))


def to_layout_key(native_key: str, layout: str) -> str:
    """The file key of a transformers-native name in `layout` (inverse of `to_native_key`)."""
    key = swap_prefix(native_key, KEY_PREFIXES[layout])
    if key is None:
        raise CheckpointError(f"no {layout} key-table row for {native_key!r}")
    return key


# ------------------------------------------------------------------------------- model dir
def find_codec_dir(model: str | Path) -> str | Path:
    """Where the codec of a v2 `model` lives when no --codec is given (the family's `load_codec`).

    `<model>/audio_tokenizer` for a local checkpoint that has one (make-checkpoint writes it
    there); otherwise the released codec repo on the hub (the released talker repo does not
    bundle its codec).
    """
    from higgs_stream.engine.codec.load import DEFAULT_HUB_ID

    local = Path(model).expanduser() / "audio_tokenizer"
    if local.is_dir():
        return local
    return DEFAULT_HUB_ID


# ------------------------------------------------------------------------------ inspection
@dataclass(frozen=True)
class TalkerCheckpoint:
    """A validated checkpoint: config, tokenizer and the native-key -> tensor plan."""

    root: Path
    layout: str  # "hf" | "original"
    raw_config: dict[str, Any]
    config: TalkerConfig  # with `special` filled from the tokenizer
    tokenizer: TextTokenizer
    tensors: dict[str, TensorEntry]  # native key -> entry, in file order

    def files(self) -> list[Path]:
        return list(dict.fromkeys(e.file for e in self.tensors.values()))


def read_config(root: Path) -> tuple[str, dict[str, Any], TalkerConfig]:
    """(layout, raw config.json, TalkerConfig without special ids) of a checkpoint directory."""
    file, raw = root / CONFIG_FILE, read_config_json(root)
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{file}: unknown model_type {model_type!r}; expected one of {sorted(MODEL_TYPES)}"
        )
    layout = MODEL_TYPES[model_type]
    archs = raw.get("architectures") or []
    unknown = [a for a in archs if a not in ARCHITECTURES[layout]]
    if unknown:
        raise CheckpointError(
            f"{file}: unknown architecture {unknown} for model_type {model_type!r}; "
            f"expected {list(ARCHITECTURES[layout])}"
        )
    try:
        cfg = TalkerConfig.from_hf_dict(raw) if layout == "hf" else TalkerConfig.from_original_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from e
    return layout, raw, cfg


def _check_special_ids(raw: Mapping[str, Any], layout: str, cfg: TalkerConfig, tok: TextTokenizer) -> None:
    """The ids config.json names must be the ones the tokenizer gives those tokens."""
    s = tok.special
    if layout == "hf":
        named = {"audio_token_id": s.audio_out, "audio_bos_token_id": s.audio_out_bos}
    else:
        named = {"audio_in_token_idx": s.audio_in, "audio_out_token_idx": s.audio_out,
                 "audio_out_bos_token_id": s.audio_out_bos, "audio_eos_token_id": s.audio_eos}
    for field, tok_id in named.items():
        if field in raw and raw[field] != tok_id:
            raise CheckpointError(f"config.json {field}={raw[field]} but the tokenizer gives id {tok_id}")
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(
            f"tokenizer has {tok.vocab_size} ids but the talker's text vocab_size is {cfg.vocab_size}"
        )


# Where each layout keeps its decoder layers, and the config.json field counting them.
LAYERS = {"hf": ("model.layers.", "num_hidden_layers"), "original": ("layers.", "text_config.num_hidden_layers")}


def expected_shapes(cfg: TalkerConfig) -> dict[str, tuple[int, ...]]:
    """Native key -> shape of every tensor a talker of this config loads (its state_dict), from a
    talker built on the meta device (no memory); call only once the layer count matches the files."""
    with torch.device("meta"):
        talker = Talker(cfg)
    return {k: tuple(v.shape) for k, v in talker.state_dict().items()}


def _plan(entries: dict[str, TensorEntry], layout: str, expected: dict[str, tuple[int, ...]]) -> dict[str, TensorEntry]:
    """Map stored keys to native keys and check them against the talker; native key -> entry."""
    plan: dict[str, TensorEntry] = {}
    for stored, entry in entries.items():
        if IGNORED_KEYS.search(stored):
            continue
        native = to_native_key(stored, layout)
        if native is None or native not in expected:
            hint = ""
            if _SPLIT_WEIGHT.search(stored):
                hint = " (training-time frozen/trainable split weights must be merged first)"
            elif native is not None and native != stored:
                hint = f" (maps to {native})"
            raise CheckpointError(f"unexpected key {stored} in {entry.file.name} for the {layout} layout{hint}")
        if native in plan:
            raise CheckpointError(f"keys {plan[native].stored_key} and {stored} both map to {native}")
        if entry.shape != expected[native]:
            raise CheckpointError(
                f"shape mismatch for {stored}: expected {list(expected[native])}, got {list(entry.shape)}"
            )
        plan[native] = entry
    missing = [k for k in expected if k not in plan and k not in OPTIONAL_KEYS]
    if missing:
        first = to_layout_key(missing[0], layout)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing key {first} in the {layout} checkpoint{more}")
    return plan


def open_checkpoint(model: str | Path) -> TalkerCheckpoint:
    """Resolve, read config + tokenizer and validate every tensor header (no weight data read)."""
    root = resolve_model_dir(model)
    layout, raw, cfg = read_config(root)
    vocab_field = "vocab_size" if layout == "hf" else "text_config.vocab_size"
    read_generation_config(root, cfg.vocab_size, f"{CONFIG_FILE} {vocab_field}")  # its ids, when it has the file
    tokenizer = TextTokenizer.from_dir(root, SpecialTokens)
    _check_special_ids(raw, layout, cfg, tokenizer)
    try:
        cfg = cfg.with_special(tokenizer.special)
    except ConfigError as e:
        raise CheckpointError(f"{root}: {e}") from e
    files, weight_map = weight_files(root)
    entries = read_headers(files, weight_map)
    prefix, field = LAYERS[layout]
    check_layer_count(cfg.num_layers, entries, prefix, field, root / CONFIG_FILE)
    plan = _plan(entries, layout, expected_shapes(cfg))
    return TalkerCheckpoint(root, layout, raw, cfg, tokenizer, plan)


# --------------------------------------------------------------------------------- loading
def iter_tensors(
    ckpt: TalkerCheckpoint, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(native key, tensor) for every planned tensor, one shard open at a time."""
    for native, t in read_tensors(ckpt.tensors):
        yield native, t.to(device=device, dtype=dtype or t.dtype)


def load_talker(
    model: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32,
    *, max_positions: int = DEFAULT_MAX_POSITIONS,
) -> tuple[Talker, TalkerConfig, TextTokenizer]:
    """(Talker, TalkerConfig, TextTokenizer) from a local checkpoint dir or a hub id.

    Layout is detected from config.json; weights are cast to `dtype` (None: as stored) on `device`
    tensor by tensor. `max_positions` is the talker's context cap.
    """
    ckpt = open_checkpoint(model)
    with parameters_on_meta():
        talker = Talker(ckpt.config, use_text_head="text_lm_head.weight" in ckpt.tensors, max_positions=max_positions)
    pending: dict[str, torch.Tensor] = {}
    current: Path | None = None
    for native, tensor in iter_tensors(ckpt, device, dtype):
        file = ckpt.tensors[native].file
        if current is not None and file != current:
            _assign(talker, pending)
        current = file
        pending[native] = tensor
    _assign(talker, pending)
    still_meta = [n for n, p in talker.named_parameters() if p.device.type == "meta"]
    assert not still_meta, f"parameters not loaded from the checkpoint: {still_meta[:4]}"
    talker.to(device)  # buffers; parameters are already there
    talker.requires_grad_(False)
    talker.eval()
    return talker, ckpt.config, ckpt.tokenizer


def _assign(talker: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Move one shard's tensors into the module (replacing meta parameters, no copy)."""
    result = talker.load_state_dict(tensors, strict=False, assign=True)
    assert not result.unexpected_keys, f"planned keys the talker lacks: {result.unexpected_keys[:4]}"
    tensors.clear()
