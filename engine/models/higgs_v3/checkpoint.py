"""Higgs Audio v3 checkpoint: on-disk layout, key table and loader.

Layout (`bosonai/higgs-audio-v3-tts-4b`, research/higgs_v3_peers.md §1.3): one directory with
config.json (model_type "higgs_multimodal_qwen3"), model.safetensors (or shards + index), and the
tokenizer files. The talker keys are

    body.layers.{i}.{11 Qwen3 layer tensors}   body.norm.weight
    tied.embedding.text_embedding.weight                  [vocab, H]  text embedding = text head
    tied.embedding.modality_embeddings.0.embedding.weight [8*1026, H] fused audio embedding = audio head

and the codec is bundled in the same files under `tied.embedding.modality_embeddings.0.model.`
(the transformers-native `HiggsAudioV2TokenizerModel` state dict); it is handed to the codec
module, whose config is the released codec's unless config.json carries our extension key
`audio_codec_config` (written only for shrunken test codecs; the real file has none).
Tied duplicates (`tied.head.text_head.weight`, `tied.head.modality_heads.0.weight`) are accepted
only when equal to the matrix they duplicate. Any other key is a CheckpointError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

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
from higgs_stream.engine.codec.codec import Codec
from higgs_stream.engine.codec.config import CodecConfig
from higgs_stream.engine.codec.load import codec_from_state_dict
from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.models.higgs_v3.config import MODEL_TYPE_V3, TalkerV3Config, V3SpecialTokens
from higgs_stream.engine.models.higgs_v3.talker import TalkerV3
from higgs_stream.engine.tokenizer import TextTokenizer

TEXT_EMBEDDING = "tied.embedding.text_embedding.weight"
AUDIO_MATRIX = "tied.embedding.modality_embeddings.0.embedding.weight"
FINAL_NORM = "body.norm.weight"
CODEC_PREFIX = "tied.embedding.modality_embeddings.0.model."
CODEC_CONFIG_KEY = "audio_codec_config"  # our extension key in config.json, test codecs only
LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
# Optional copies of tied matrices -> the key they must equal.
TIED_COPIES = {
    "tied.head.text_head.weight": TEXT_EMBEDDING,
    "tied.head.modality_heads.0.weight": AUDIO_MATRIX,
}
# Checkpoint prefix -> transformers `Qwen3ForCausalLM` prefix (the peers' `_BACKBONE_PREFIX_MAP`).
QWEN3_PREFIXES = {
    "tied.embedding.text_embedding.": "model.embed_tokens.",
    "body.layers.": "model.layers.",
    "body.norm.": "model.norm.",
}


def talker_key_shapes(cfg: TalkerV3Config) -> dict[str, tuple[int, ...]]:
    """Every talker tensor of a v3 checkpoint with its shape (the key table)."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg.num_heads * d, h),
        "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.o_proj.weight": (h, cfg.num_heads * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "mlp.up_proj.weight": (cfg.intermediate_size, h),
        "mlp.down_proj.weight": (h, cfg.intermediate_size),
    }
    assert tuple(per_layer) == LAYER_TENSORS, "key table out of sync with LAYER_TENSORS"
    table = {f"body.layers.{i}.{name}": shape for i in range(cfg.num_layers) for name, shape in per_layer.items()}
    table[FINAL_NORM] = (h,)
    table[TEXT_EMBEDDING] = (cfg.vocab_size, h)
    table[AUDIO_MATRIX] = (cfg.num_codebooks * cfg.audio_vocab, h)
    return table


def to_qwen3_key(key: str) -> str:
    """A v3 backbone key -> the transformers `Qwen3ForCausalLM` parameter name."""
    qwen3 = swap_prefix(key, QWEN3_PREFIXES.items())
    if qwen3 is None:
        raise CheckpointError(f"{key!r} is not a v3 backbone key")
    return qwen3


def classify_keys(
    shapes: Mapping[str, tuple[int, ...]], cfg: TalkerV3Config
) -> tuple[list[str], list[str], list[str]]:
    """Checkpoint key -> shape (headers only) -> (talker keys, codec keys, tied-copy keys).

    CheckpointError naming the key on: a wrong shape, a missing talker key, no codec tensors,
    or any key outside the table.
    """
    table = talker_key_shapes(cfg)
    talker, codec, copies = [], [], []
    for key, shape in shapes.items():
        if key.startswith(CODEC_PREFIX):
            codec.append(key)
        elif key in table:
            if tuple(shape) != table[key]:
                raise CheckpointError(f"v3 checkpoint tensor {key} has shape {list(shape)}, expected {list(table[key])}")
            talker.append(key)
        elif key in TIED_COPIES:
            if tuple(shape) != table[TIED_COPIES[key]]:
                raise CheckpointError(f"v3 checkpoint tensor {key} has shape {list(shape)}, expected "
                                      f"{list(table[TIED_COPIES[key]])} (a copy of {TIED_COPIES[key]})")
            copies.append(key)
        else:
            raise CheckpointError(f"unexpected key {key} in the v3 checkpoint")
    missing = [k for k in table if k not in set(talker)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"missing key {missing[0]} in the v3 checkpoint{more}")
    if not codec:
        raise CheckpointError(f"the v3 checkpoint has no bundled codec tensors (prefix {CODEC_PREFIX})")
    return talker, codec, copies


# ----------------------------------------------------------------------------------- loading
def read_config_v3(root: Path) -> tuple[dict[str, Any], TalkerV3Config]:
    """(raw config.json, TalkerV3Config without special ids); CheckpointError if it is not v3."""
    file, raw = root / CONFIG_FILE, read_config_json(root)
    if raw.get("model_type") != MODEL_TYPE_V3:
        raise CheckpointError(f"{file}: model_type {raw.get('model_type')!r} is not {MODEL_TYPE_V3!r}")
    try:
        return raw, TalkerV3Config.from_hf_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{file}: {e}") from e


def is_v3_checkpoint(model: str | Path) -> bool:
    """True when `model`'s config.json says model_type "higgs_multimodal_qwen3"."""
    return read_config_json(resolve_model_dir(model)).get("model_type") == MODEL_TYPE_V3


def _open(model: str | Path) -> tuple[Path, dict[str, Any], TalkerV3Config, TextTokenizer, dict[str, TensorEntry]]:
    root = resolve_model_dir(model)
    raw, cfg = read_config_v3(root)
    read_generation_config(root, cfg.vocab_size, f"{CONFIG_FILE} text_config.vocab_size")  # its ids, when present
    tokenizer = TextTokenizer.from_dir(root, V3SpecialTokens)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} ids but the v3 text vocab_size is {cfg.vocab_size}")
    eos = raw["text_config"].get("eos_token_id")  # text_config: a dict, or from_hf_dict raised
    if eos is not None and eos not in (tokenizer.special.end_of_text, [tokenizer.special.end_of_text]):
        raise CheckpointError(f"config.json text_config.eos_token_id={eos} but the tokenizer gives <|endoftext|> "
                              f"id {tokenizer.special.end_of_text}")
    try:
        cfg = cfg.with_special(tokenizer.special)
    except ConfigError as e:
        raise CheckpointError(f"{root}: {e}") from e
    files, weight_map = weight_files(root)
    return root, raw, cfg, tokenizer, read_headers(files, weight_map)


def _read(entries: Mapping[str, TensorEntry], keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors `keys`, one file open at a time, in their stored dtype, on CPU."""
    return dict(read_tensors({key: entries[key] for key in keys}))


def load_talker_v3(
    model: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    *, max_positions: int = DEFAULT_MAX_POSITIONS,
) -> tuple[TalkerV3, TalkerV3Config, TextTokenizer]:
    """(TalkerV3, TalkerV3Config with special ids, tokenizer with V3SpecialTokens) from a v3
    checkpoint dir or hub id.

    Every talker tensor, the fused audio matrix included, is cast to `dtype` (None: as stored), as
    sglang-omni's loader does: a bf16 matrix beside an fp32 backbone would take the embedding sums
    and audio logits in bf16. Audio and text logits are fp32 either way.
    The bundled codec's tensors are checked for presence here and loaded by `load_codec_v3`.
    `max_positions` is the talker's context cap.
    """
    root, _, cfg, tokenizer, entries = _open(model)
    # before the key table, which has a row per layer
    check_layer_count(cfg.num_layers, entries, "body.layers.", "text_config.num_hidden_layers", root / CONFIG_FILE)
    talker_keys, _, copy_keys = classify_keys({k: e.shape for k, e in entries.items()}, cfg)
    with parameters_on_meta():
        talker = TalkerV3(cfg, max_positions=max_positions)
    tensors = _read(entries, talker_keys + copy_keys)
    for key in copy_keys:
        if not torch.equal(tensors.pop(key), tensors[TIED_COPIES[key]]):
            raise CheckpointError(f"{key} differs from {TIED_COPIES[key]}: untied heads are not supported")
    for key, t in tensors.items():
        tensors[key] = t.to(device=device, dtype=dtype or t.dtype)
    result = talker.load_state_dict(tensors, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys, f"key table out of sync: {result}"
    talker.to(device)  # buffers (RoPE inverse frequencies, codebook offsets)
    talker.requires_grad_(False)
    talker.eval()
    return talker, cfg, tokenizer


def codec_config_v3(raw: Mapping[str, Any]) -> CodecConfig:
    """The bundled codec's config: the released codec's, unless our extension key describes another."""
    given = raw.get(CODEC_CONFIG_KEY)
    if given is None:
        return CodecConfig.full()
    try:
        return CodecConfig.from_hf_dict(given)
    except ConfigError as e:
        raise CheckpointError(f"config.json {CODEC_CONFIG_KEY}: {e}") from e


def load_codec_v3(model: str | Path, device: str | torch.device = "cpu", with_encoder: bool | None = None) -> Codec:
    """The codec bundled in a v3 checkpoint (fp32 on `device`)."""
    root = resolve_model_dir(model)
    raw, _ = read_config_v3(root)
    files, weight_map = weight_files(root)
    entries = read_headers(files, weight_map)
    keys = [k for k in entries if k.startswith(CODEC_PREFIX)]
    if not keys:
        raise CheckpointError(f"the v3 checkpoint {root} has no bundled codec tensors (prefix {CODEC_PREFIX})")
    return codec_from_state_dict(_read(entries, keys), codec_config_v3(raw), layout="hf", prefix=CODEC_PREFIX,
                                 device=device, with_encoder=with_encoder)
