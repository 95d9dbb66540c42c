"""`higgs-stream make-checkpoint --arch v2`: write a random-weight Higgs Audio v2 checkpoint on disk.

No machine here reaches the model hub, so the loaders are tested on checkpoints written here in
the real on-disk layouts (SPEC "Weights on these machines"; shared writer helpers in
engine/checkpoint_writer.py):

* talker: `config.json`, safetensors (one file, or shards + `model.safetensors.index.json`),
  `generation_config.json`, in the transformers-native layout ("hf", what
  `HiggsAudioV2ForConditionalGeneration.save_pretrained` writes; pinned by tests against the
  transformers classes) or Boson's original one ("original": same tensors renamed through
  `checkpoint.KEY_PREFIXES`, nested Llama `text_config`, model_type "higgs_audio").
* text tokenizer: a real byte-level BPE trained here on a built-in English snippet, with the
  256 Llama-3 special tokens (Higgs names included) on top, at 128000.. for "full" (BPE vocab
  padded with unreachable filler tokens) and at 512.. for "tiny". `tokenizer.json`,
  `tokenizer_config.json`, `special_tokens_map.json`.
* codec: `OUT/audio_tokenizer/` through `engine.codec.make.write_random_codec`.

Weights: every tensor has its own generator seeded from (seed, tensor name), so a tensor's
values do not depend on the layout, the shard size or the order of writing, and the 3B preset
streams tensor by tensor into the shard files (peak memory one tensor: about 4.6 GB RSS
measured for the 3B preset, ~4 min on 2 CPU cores). Linear/embedding weights are
N(0, std^2); RMSNorm weights are 1 + N(0, 0.1^2), not all ones, so a text/audio norm mix-up
changes the logits. Never present audio from these weights as speech.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, processors

from higgs_stream.engine.checkpoint_files import CONFIG_FILE
from higgs_stream.engine.checkpoint_writer import (
    PRESETS,
    check_seed,
    empty_output_dir,
    numel,
    random_tensor,
    train_bpe,
    write_json,
    write_safetensors,
    write_shards,
)
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.models.higgs_v2.checkpoint import to_layout_key
from higgs_stream.engine.models.higgs_v2.config import (
    LLAMA3_ROPE_SCALING,
    SPECIAL_TOKEN_STRINGS,
    SpecialTokens,
    TalkerConfig,
)

LAYOUTS = ("hf", "original")
NUM_SPECIAL_TOKENS = 256  # Llama-3 reserves 256 special ids at the top of its vocabulary


# ------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class Preset:
    name: str
    bpe_vocab: int  # ids below the special tokens (trained merges + filler)
    dims: dict[str, int]  # TalkerConfig architecture fields
    dtype: torch.dtype
    init_std: float
    shard_bytes: int  # shard size limit (HF semantics: a bigger tensor gets a shard of its own)


_PRESETS = {
    # Same dims as TalkerConfig.tiny(); init std 0.1 gives projections about the output scale
    # that std 0.02 gives at hidden 3072. Small shards so the tiny checkpoint is sharded too.
    "tiny": Preset("tiny", 512, dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                     num_kv_heads=2, head_dim=16), torch.float32, 0.1, 2_000_000),
    # higgs-audio-v2-generation-3B-base: 11,542,566,912 bytes in bf16, 3 shards of <= 5 GB.
    "full": Preset("full", 128000, dict(hidden_size=3072, intermediate_size=8192, num_layers=28,
                                        num_heads=24, num_kv_heads=8, head_dim=128), torch.bfloat16,
                   0.02, 5_000_000_000),
}

# llama3 RoPE scaling as each layout spells it (mathematically identical: both give wavelength
# thresholds 8192/2048 and smoothing (8192/lambda - 1)/3, research/higgs_v2_reference.md §1.1).
_ROPE_THETA = 500000.0
_HF_ROPE = {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 0.5, "low_freq_factor": 0.125,
            "original_max_position_embeddings": 1024}
_ORIGINAL_ROPE = LLAMA3_ROPE_SCALING
_HF_MAX_POSITIONS = 2048  # HiggsAudioV2Config default, what the conversion script wrote
_ORIGINAL_MAX_POSITIONS = 131072  # Llama-3.2 text_config of the released model
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ------------------------------------------------------------------------- special tokens
def llama3_special_tokens() -> list[str]:
    """The 256 special token strings of the Higgs tokenizer, in id order (offset 0 = 128000)."""
    named = {
        0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
        10: "<|python_tag|>", 11: "<|audio_bos|>", 12: "<|audio_eos|>", 13: "<|audio_out_bos|>",
        15: "<|AUDIO|>", 16: "<|AUDIO_OUT|>", 17: "<|recipient|>", 18: "<|scene_desc_start|>",
        19: "<|scene_desc_end|>", 20: "<|generation_instruction_start|>",
        21: "<|generation_instruction_end|>", 22: "<SE>", 23: "</SE>", 24: "<SE_s>", 25: "</SE_s>",
        26: "<SE_e>", 27: "</SE_e>",
    }
    # Unnamed slots keep Llama-3's reserved names: 2,3 -> 0,1; 5 -> 2; 14 -> 6; k>=28 -> k-8.
    reserved = {2: 0, 3: 1, 5: 2, 14: 6}
    out = []
    for k in range(NUM_SPECIAL_TOKENS):
        if k in named:
            out.append(named[k])
        else:
            out.append(f"<|reserved_special_token_{reserved.get(k, k - 8)}|>")
    return out


def special_ids(base: int) -> SpecialTokens:
    """SpecialTokens of a vocabulary whose 256 special tokens start at `base`."""
    offsets = {tok: k for k, tok in enumerate(llama3_special_tokens())}
    return SpecialTokens(**{field: base + offsets[tok] for field, tok in SPECIAL_TOKEN_STRINGS.items()})


def talker_config(preset: str) -> TalkerConfig:
    """The TalkerConfig a preset's checkpoint describes (special ids included)."""
    p = _preset(preset)
    return TalkerConfig(
        vocab_size=p.bpe_vocab + NUM_SPECIAL_TOKENS, **p.dims, rms_norm_eps=1e-5, rope_theta=_ROPE_THETA,
        rope_scaling=dict(_ORIGINAL_ROPE), max_position_embeddings=_ORIGINAL_MAX_POSITIONS,
        special=special_ids(p.bpe_vocab),
    )


def _preset(name: str) -> Preset:
    if name not in _PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {PRESETS}")
    return _PRESETS[name]


# ------------------------------------------------------------------------------ tokenizer
def build_text_tokenizer(bpe_vocab: int) -> Tokenizer:
    """Byte-level BPE with exactly `bpe_vocab` ids, then the 256 special tokens on top."""
    tok = train_bpe(bpe_vocab)
    specials = llama3_special_tokens()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False,
                                       single_word=False) for t in specials])
    assert tok.token_to_id(specials[0]) == bpe_vocab, "special tokens must start right after the BPE vocab"
    assert tok.get_vocab_size(with_added_tokens=True) == bpe_vocab + NUM_SPECIAL_TOKENS
    bos = specials[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bpe_vocab)]
    )
    return tok


def write_tokenizer(out: Path, bpe_vocab: int) -> None:
    tok = build_text_tokenizer(bpe_vocab)
    tok.save(str(out / "tokenizer.json"))
    specials = llama3_special_tokens()
    entry = dict(lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
    tokenizer_config = {
        "added_tokens_decoder": {str(bpe_vocab + k): {"content": t, **entry} for k, t in enumerate(specials)},
        "bos_token": specials[0],
        "clean_up_tokenization_spaces": True,
        "eos_token": specials[1],
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    write_json(out / "tokenizer_config.json", tokenizer_config)
    token = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    write_json(out / "special_tokens_map.json", {"bos_token": {"content": specials[0], **token},
                                                  "eos_token": {"content": specials[1], **token}})


# ----------------------------------------------------------------------------- config files
def hf_config_dict(cfg: TalkerConfig, preset: Preset) -> dict[str, Any]:
    """config.json of the transformers-native layout (the fields HiggsAudioV2Config writes)."""
    s = cfg.special
    assert s is not None
    return {
        "architectures": ["HiggsAudioV2ForConditionalGeneration"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "audio_bos_token_id": s.audio_out_bos,
        "audio_delay_token_id": s.begin_of_text + 14,  # <|reserved_special_token_6|>
        "audio_stream_bos_id": cfg.audio_stream_bos_id,
        "audio_stream_eos_id": cfg.audio_stream_eos_id,
        "audio_token_id": s.audio_out,
        "bos_token_id": 1,  # sic: the HiggsAudioV2Config default the conversion script kept
        "codebook_size": cfg.audio_vocab,  # embedding rows per codebook: 1024 codes + BOS + EOS
        "dtype": _DTYPE_NAMES[preset.dtype],
        "eos_token_id": s.eot,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": preset.init_std,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": _HF_MAX_POSITIONS,
        "mlp_bias": False,
        "model_type": "higgs_audio_v2",
        "num_attention_heads": cfg.num_heads,
        "num_codebooks": cfg.num_codebooks,
        "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_kv_heads,
        "pad_token_id": s.end_of_text,
        "pretraining_tp": 1,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {**_HF_ROPE, "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": False,
        "transformers_version": "5.24.0",
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
    }


def original_config_dict(cfg: TalkerConfig, preset: Preset) -> dict[str, Any]:
    """config.json of Boson's layout (the released file's fields, research/higgs_v2_reference.md §1.2)."""
    s = cfg.special
    assert s is not None
    dtype = _DTYPE_NAMES[preset.dtype]
    text_config = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": s.begin_of_text, "eos_token_id": s.end_of_text, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "hidden_size": cfg.hidden_size, "initializer_range": preset.init_std,
        "intermediate_size": cfg.intermediate_size, "max_position_embeddings": _ORIGINAL_MAX_POSITIONS,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers, "num_key_value_heads": cfg.num_kv_heads,
        "pretraining_tp": 1, "rms_norm_eps": cfg.rms_norm_eps, "rope_scaling": dict(_ORIGINAL_ROPE),
        "rope_theta": cfg.rope_theta, "tie_word_embeddings": True, "torch_dtype": dtype,
        "use_cache": True, "vocab_size": cfg.vocab_size,
    }
    audio_encoder_config = {  # Whisper-large-v3 encoder; not built (skip_audio_tower), no weights
        "model_type": "higgs_audio_encoder", "d_model": 1280, "encoder_layers": 32,
        "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "num_hidden_layers": 32,
        "num_mel_bins": 128, "max_source_positions": 1500, "activation_function": "gelu",
        "pad_token_id": s.end_of_text,
    }
    return {
        "architectures": ["HiggsAudioModel"],
        "audio_adapter_type": "dual_ffn_fast_forward",
        "audio_bos_token": "<|audio_bos|>",
        "audio_codebook_size": cfg.codebook_size,
        "audio_decoder_proj_num_layers": 0,
        "audio_dual_ffn_layers": list(range(cfg.num_layers)),
        "audio_embed_avg": False,
        "audio_encoder_config": audio_encoder_config,
        "audio_eos_token": "<|audio_eos|>",
        "audio_eos_token_id": s.audio_eos,
        "audio_ffn_hidden_size": cfg.hidden_size,
        "audio_ffn_intermediate_size": cfg.intermediate_size,
        "audio_in_token": "<|AUDIO|>",
        "audio_in_token_idx": s.audio_in,
        "audio_num_codebooks": cfg.num_codebooks,
        "audio_out_bos_token": "<|audio_out_bos|>",
        "audio_out_bos_token_id": s.audio_out_bos,
        "audio_out_token": "<|AUDIO_OUT|>",
        "audio_out_token_idx": s.audio_out,
        "audio_stream_bos_id": cfg.audio_stream_bos_id,
        "audio_stream_eos_id": cfg.audio_stream_eos_id,
        "audio_tokenizer_config": None,
        "encode_audio_in_tokens": True,
        "encode_whisper_embed": False,
        "hidden_size": cfg.hidden_size,
        "model_type": "higgs_audio",
        "pad_token_id": s.end_of_text,
        "rq_transformer_hidden_size": None,
        "rq_transformer_intermediate_size": None,
        "rq_transformer_num_attention_heads": None,
        "rq_transformer_num_hidden_layers": 3,
        "rq_transformer_num_key_value_heads": None,
        "skip_audio_tower": True,
        "text_config": text_config,
        "torch_dtype": dtype,
        "transformers_version": "4.46.3",
        "use_audio_out_embed_projector": False,
        "use_audio_out_self_attention": 0,
        "use_delay_pattern": True,
        "use_rq_transformer": False,
    }


def generation_config_dict(cfg: TalkerConfig, layout: str) -> dict[str, Any]:
    s = cfg.special
    assert s is not None
    if layout == "hf":  # what the transformers conversion script sets
        return {"_from_model_config": False, "bos_token_id": 1, "eos_token_id": s.eot,
                "pad_token_id": s.end_of_text, "ras_win_len": 7, "ras_win_max_num_repeat": 2,
                "transformers_version": "5.24.0", "use_text_head": True}
    return {"_from_model_config": True, "bos_token_id": s.begin_of_text, "eos_token_id": s.end_of_text,
            "pad_token_id": s.end_of_text, "transformers_version": "4.46.3"}


# -------------------------------------------------------------------------------- weights
def tensor_plan(cfg: TalkerConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(transformers-native key, shape) of every talker tensor, in the order transformers saves."""
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    plan: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        plan += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                 (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q))]
        for mlp in ("mlp", "audio_mlp"):
            plan += [(p + f"{mlp}.gate_proj.weight", (f, h)), (p + f"{mlp}.up_proj.weight", (f, h)),
                     (p + f"{mlp}.down_proj.weight", (h, f))]
            if mlp == "mlp":
                plan += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
        plan += [(p + "audio_input_layernorm.weight", (h,)), (p + "audio_post_attention_layernorm.weight", (h,))]
    rows = cfg.num_codebooks * cfg.audio_vocab
    plan += [("model.norm.weight", (h,)), ("model.embed_audio_tokens.embed_audio_tokens.weight", (rows, h)),
             ("audio_lm_head.weight", (rows, h)), ("text_lm_head.weight", (v, h))]
    return plan


def write_weights(out: Path, cfg: TalkerConfig, layout: str, seed: int, preset: Preset,
                  shard_bytes: int | None = None) -> list[str]:
    """Write the talker safetensors (+ index when sharded); returns the file names written."""
    plan = tensor_plan(cfg)
    elem = torch.empty((), dtype=preset.dtype).element_size()
    sizes = [elem * numel(shape) for _, shape in plan]

    def write(path: Path, items: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        stored = [(to_layout_key(key, layout), key, shape) for key, shape in items]
        write_safetensors(
            path,
            [(name, shape, preset.dtype) for name, _, shape in stored],
            (random_tensor(key, shape, seed, preset.init_std, preset.dtype) for _, key, shape in stored),
        )
        return [name for name, _, _ in stored]

    return write_shards(out, plan, sizes, shard_bytes or preset.shard_bytes, write)


# ------------------------------------------------------------------------------ top level
def make_checkpoint(out: str | Path, preset: str = "tiny", layout: str = "hf", seed: int = 0, *,
                    codec: bool = True, shard_bytes: int | None = None) -> Path:
    """Write a random-weight talker + tokenizer (+ codec in OUT/audio_tokenizer) to `out`.

    `out` must be missing or an empty directory. `codec=False` skips the codec (tests of the
    talker files only); `shard_bytes` overrides the preset's shard size limit.
    """
    p = _preset(preset)
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    check_seed(seed)
    out = empty_output_dir(out)
    cfg = talker_config(preset)
    config = hf_config_dict(cfg, p) if layout == "hf" else original_config_dict(cfg, p)
    write_json(out / CONFIG_FILE, config)
    write_json(out / "generation_config.json", generation_config_dict(cfg, layout))
    write_tokenizer(out, p.bpe_vocab)
    write_weights(out, cfg, layout, seed, p, shard_bytes)
    if codec:
        from higgs_stream.engine.codec.make import write_random_codec

        write_random_codec(out / "audio_tokenizer", preset=preset, layout=layout, seed=seed)
    return out
