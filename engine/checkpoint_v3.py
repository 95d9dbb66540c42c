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

import torch

from higgs_stream.engine.config_v3 import TalkerV3Config
from higgs_stream.engine.errors import CheckpointError

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
    for ours, theirs in QWEN3_PREFIXES.items():
        if key.startswith(ours):
            return theirs + key[len(ours):]
    raise CheckpointError(f"{key!r} is not a v3 backbone key")


def split_state_dict(
    tensors: Mapping[str, torch.Tensor], cfg: TalkerV3Config
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Checkpoint tensors -> (talker state dict, codec state dict with CODEC_PREFIX stripped).

    CheckpointError naming the key on: a missing talker key, a wrong shape, a tied copy that
    differs from its source, an empty codec, or any key outside the table.
    """
    table = talker_key_shapes(cfg)
    talker: dict[str, torch.Tensor] = {}
    codec: dict[str, torch.Tensor] = {}
    copies: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key.startswith(CODEC_PREFIX):
            codec[key[len(CODEC_PREFIX):]] = tensor
        elif key in table:
            if tuple(tensor.shape) != table[key]:
                raise CheckpointError(f"v3 checkpoint tensor {key} has shape {tuple(tensor.shape)}, expected {table[key]}")
            talker[key] = tensor
        elif key in TIED_COPIES:
            copies[key] = tensor
        else:
            raise CheckpointError(f"unexpected tensor {key!r} in v3 checkpoint")
    missing = [k for k in table if k not in talker]
    if missing:
        raise CheckpointError(f"v3 checkpoint lacks {len(missing)} talker tensors, first {missing[0]!r}")
    for key, tensor in copies.items():
        source = talker[TIED_COPIES[key]]
        if tensor.shape != source.shape or not torch.equal(tensor, source):
            raise CheckpointError(f"{key} differs from {TIED_COPIES[key]}: untied heads are not supported")
    if not codec:
        raise CheckpointError(f"v3 checkpoint has no bundled codec tensors under {CODEC_PREFIX!r}")
    return talker, codec
