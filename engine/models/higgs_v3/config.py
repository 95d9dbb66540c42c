"""Higgs Audio v3 talker configuration (`model_type="higgs_multimodal_qwen3"`).

The v3 checkpoint's config.json nests a stock Qwen3 `text_config` (RoPE theta inside
`rope_parameters`) and a discrete `audio_encoder_config` (8 codebooks x 1026 ids, tied fused
embedding/head). Everything else a v3 stream needs (the special text tokens of the prompt and the
stop ids) is data from the tokenizer: `V3SpecialTokens`, filled by the loader, never hard-coded.
Reference: research/higgs_v3_peers.md §1.2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from higgs_stream.engine.config_fields import dict_field, dtype_fields, float_field, hf_token_ids, int_field
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.special_tokens import SpecialTokenIds
from higgs_stream.engine.talker_config import BackboneConfig, backbone_dims, max_positions_field

MODEL_TYPE_V3 = "higgs_multimodal_qwen3"

# Field -> token string in the v3 tokenizer's added vocabulary. `ref_text` is optional (older
# checkpoints only support audio-only voice cloning); all others are required.
V3_SPECIAL_TOKEN_STRINGS: dict[str, str] = {
    "tts": "<|tts|>",
    "text": "<|text|>",
    "audio": "<|audio|>",
    "ref_audio": "<|ref_audio|>",
    "ref_text": "<|ref_text|>",
    "end_of_text": "<|endoftext|>",
    "audio_end": "<|audio_end|>",
}
_OPTIONAL_SPECIALS = ("ref_text",)

# Where the full-size random-weight preset puts the specials. Only `<|endoftext|>` 151643 and
# `<|audio_end|>` 151671 are known from peers (vllm-omni pipeline.py); the other ids of the real
# tokenizer are not public, so this layout is ours. Real checkpoints always read their tokenizer.
_FULL_PRESET_IDS: dict[str, int] = {
    "end_of_text": 151643,
    "tts": 151669,
    "text": 151670,
    "audio_end": 151671,
    "audio": 151672,
    "ref_audio": 151673,
    "ref_text": 151674,
}


@dataclass(frozen=True)
class V3SpecialTokens(SpecialTokenIds):
    """Ids of the v3 prompt tokens and stop tokens, resolved from the tokenizer (checks and
    constructors: engine/special_tokens.py)."""

    # what tokenizer.TextTokenizer resolves: field -> token string, and the fields that may be absent
    TOKEN_STRINGS: ClassVar[Mapping[str, str]] = V3_SPECIAL_TOKEN_STRINGS
    OPTIONAL: ClassVar[tuple[str, ...]] = _OPTIONAL_SPECIALS
    LABEL: ClassVar[str] = "v3 special token"

    tts: int
    text: int
    audio: int
    ref_audio: int
    end_of_text: int
    audio_end: int
    ref_text: int | None = None

    @property
    def stop_ids(self) -> tuple[int, int]:
        """Text ids that end a v3 stream: `<|endoftext|>` and `<|audio_end|>`."""
        return (self.end_of_text, self.audio_end)

    @classmethod
    def full_preset(cls) -> V3SpecialTokens:
        return cls(**_FULL_PRESET_IDS)


@dataclass(frozen=True)
class TalkerV3Config(BackboneConfig):
    """Validated architecture of the v3 talker: a Qwen3 backbone plus the tied fused audio matrix."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768  # as config.json says; not a limit (EngineConfig.max_seq_len is)
    num_codebooks: int = 8
    codebook_size: int = 1024
    audio_stream_bos_id: int = 1024
    audio_stream_eos_id: int = 1025
    audio_token_id: int = -100
    special: V3SpecialTokens | None = field(default=None)

    def __post_init__(self) -> None:
        self.validate_backbone()

    @property
    def rope_scaling(self) -> None:
        """Qwen3 uses plain RoPE (for code shared with the v2 talker, which reads this field)."""
        return None

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> TalkerV3Config:
        """From the v3 checkpoint's config.json (model_type "higgs_multimodal_qwen3")."""
        if d.get("model_type") != MODEL_TYPE_V3:
            raise ConfigError(f"expected model_type {MODEL_TYPE_V3!r}, got {d.get('model_type')!r}")
        text = dict_field(d, "text_config")
        audio = dict_field(d, "audio_encoder_config")
        if text.get("model_type", "qwen3") != "qwen3":
            raise ConfigError(f"v3 text_config must be qwen3, got model_type {text.get('model_type')!r}")
        if text.get("hidden_act", "silu") != "silu" or text.get("attention_bias"):
            raise ConfigError("v3 text_config: only silu activations without attention bias are supported")
        if text.get("tie_word_embeddings") is not True:
            raise ConfigError("v3 text_config must have tie_word_embeddings=true (text head = text embedding)")
        if text.get("use_sliding_window"):
            raise ConfigError("v3 text_config: sliding-window attention is not supported")
        if audio.get("encoder_type") != "discrete":
            raise ConfigError(f"v3 audio_encoder_config.encoder_type must be 'discrete', got {audio.get('encoder_type')!r}")
        if audio.get("tie_word_embeddings") is not True or audio.get("use_delay_pattern") is not True:
            raise ConfigError("v3 audio_encoder_config must have tie_word_embeddings=true and use_delay_pattern=true")
        dims = backbone_dims(text, "text_config.")
        hidden, vocab = dims["hidden_size"], dims["vocab_size"]
        hf_token_ids(text, "text_config.", vocab, "text_config.vocab_size")
        dtype_fields(d)
        dtype_fields(text, "text_config.")
        out_dim = int_field(audio, "out_dim", "audio_encoder_config.", hidden)
        if out_dim != hidden:
            raise ConfigError(f"v3 audio_encoder_config.out_dim {out_dim} != text hidden_size {hidden}")
        rope = dict_field(text, "rope_parameters", "text_config.", None)
        if rope is not None and rope.get("rope_theta") is not None:
            if rope.get("rope_type", "default") != "default":
                raise ConfigError(f"v3 supports plain RoPE only, got rope_parameters={rope}")
            theta = float_field(rope, "rope_theta", "text_config.rope_parameters.")
        elif text.get("rope_theta") is not None:
            theta = float_field(text, "rope_theta", "text_config.")
        elif "rope_theta" in text or "rope_theta" in (rope or {}):  # null: Qwen3's default
            theta = cls.rope_theta
        else:
            raise ConfigError("v3 text_config lacks rope_parameters.rope_theta (and rope_theta)")
        rows = int_field(audio, "vocab_size", "audio_encoder_config.", lo=3)  # ids per codebook (1026)
        num_codebooks = int_field(audio, "num_codebooks", "audio_encoder_config.")
        return cls(
            **dims,
            rms_norm_eps=float_field(text, "rms_norm_eps", "text_config."),
            rope_theta=float(theta),
            max_position_embeddings=max_positions_field(text, "text_config.", 32768, num_codebooks),
            num_codebooks=num_codebooks,
            codebook_size=rows - 2,
            audio_stream_bos_id=int_field(d, "audio_stream_bos_id", default=rows - 2, lo=0),
            audio_stream_eos_id=int_field(d, "audio_stream_eos_id", default=rows - 1, lo=0),
            # a placeholder (-100, transformers' ignore index, in the released file) or a text id
            audio_token_id=int_field(d, "audio_token_id", default=-100, lo=None, hi=vocab - 1,
                                     why=f"negative: none; else an id of the text_config.vocab_size={vocab} table"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a v3 checkpoint carries (the inverse of `from_hf_dict`)."""
        text: dict[str, Any] = dict(
            model_type="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, hidden_act="silu",
            tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )
        if self.special is not None:
            text.update(bos_token_id=self.special.end_of_text, eos_token_id=self.special.end_of_text)
        return {
            "model_type": MODEL_TYPE_V3,
            "architectures": ["HiggsMultimodalQwen3ForConditionalGeneration"],
            "auto_map": None,
            "audio_token_id": self.audio_token_id,
            "text_config": text,
            "audio_encoder_config": {
                "encoder_type": "discrete", "num_codebooks": self.num_codebooks,
                "vocab_size": self.audio_vocab, "out_dim": self.hidden_size,
                "use_delay_pattern": True, "tie_word_embeddings": True,
            },
        }

    @classmethod
    def tiny(cls, **overrides: Any) -> TalkerV3Config:
        """A small random-weight v3 talker for CPU tests (specials at the top of a 300-token vocab)."""
        base: dict[str, Any] = dict(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            max_position_embeddings=4096, special=V3SpecialTokens.consecutive(288),
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def full(cls, **overrides: Any) -> TalkerV3Config:
        """The released Qwen3-4B architecture (higgs-audio-v3-tts-4b)."""
        base: dict[str, Any] = dict(
            vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
            num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            max_position_embeddings=32768, special=V3SpecialTokens.full_preset(),
        )
        base.update(overrides)
        return cls(**base)
