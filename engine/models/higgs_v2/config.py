"""Talker (Higgs Audio v2 LLM) configuration.

Two on-disk config layouts map onto one validated `TalkerConfig`:

* transformers-native (`model_type="higgs_audio_v2"`): flat. Its `codebook_size` is the number of
  embedding rows per codebook, i.e. 1026 for the released model (1024 codes + stream BOS + EOS);
  the conversion script builds `HiggsAudioV2Config(codebook_size=1026)`.
* Boson's original (`model_type="higgs_audio"`): a Llama `text_config` nested inside, and
  `audio_codebook_size=1024` counting real codes only (the model adds 2).

Here `codebook_size` always means real codes (1024) and `audio_vocab` = codebook_size + 2 the
per-codebook vocabulary (1026). Special text token ids are data (`SpecialTokens`): the checkpoint
loader fills them from the tokenizer; the presets only exist for random-weight models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from higgs_stream.engine.config_fields import (
    dict_field,
    dtype_fields,
    float_field,
    hf_token_ids,
    int_field,
    token_id_field,
)
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.special_tokens import SpecialTokenIds
from higgs_stream.engine.talker_config import BackboneConfig, backbone_dims, max_positions_field

# Text token ids each layout's config.json names beside transformers' bos/eos/pad (each checked against the
# tokenizer too, where it names a token of ours: checkpoint.py). All index the text embedding (vocab_size rows).
HF_TEXT_ID_KEYS = ("audio_token_id", "audio_bos_token_id", "audio_delay_token_id")
ORIGINAL_TEXT_ID_KEYS = ("pad_token_id", "audio_in_token_idx", "audio_out_token_idx", "audio_out_bos_token_id",
                         "audio_eos_token_id")

# The token string of every `SpecialTokens` field, as spelled in the Higgs tokenizer.
SPECIAL_TOKEN_STRINGS: dict[str, str] = {
    "begin_of_text": "<|begin_of_text|>",
    "end_of_text": "<|end_of_text|>",
    "start_header": "<|start_header_id|>",
    "end_header": "<|end_header_id|>",
    "eot": "<|eot_id|>",
    "eom": "<|eom_id|>",
    "audio_bos": "<|audio_bos|>",
    "audio_eos": "<|audio_eos|>",
    "audio_out_bos": "<|audio_out_bos|>",
    "audio_in": "<|AUDIO|>",
    "audio_out": "<|AUDIO_OUT|>",
    "scene_desc_start": "<|scene_desc_start|>",
    "scene_desc_end": "<|scene_desc_end|>",
}

# Ids of those tokens in the released Llama-3-based Higgs tokenizer (research/higgs_v2_reference.md
# §3.1). Used only by the `full()` random-weight preset; real checkpoints read their tokenizer.
_LLAMA3_HIGGS_IDS: dict[str, int] = {
    "begin_of_text": 128000,
    "end_of_text": 128001,
    "start_header": 128006,
    "end_header": 128007,
    "eot": 128009,
    "eom": 128008,
    "audio_bos": 128011,
    "audio_eos": 128012,
    "audio_out_bos": 128013,
    "audio_in": 128015,
    "audio_out": 128016,
    "scene_desc_start": 128018,
    "scene_desc_end": 128019,
}

# The released model's RoPE scaling in the original spelling (the transformers port writes the same
# frequencies as 0.125 / 0.5 / 1024; research/higgs_v2_reference.md §1.1).
LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class SpecialTokens(SpecialTokenIds):
    """Ids of the special text tokens the prompt builder and generation loop use (checks and
    constructors: engine/special_tokens.py)."""

    # what tokenizer.TextTokenizer resolves: field -> token string; every one is required
    TOKEN_STRINGS: ClassVar[Mapping[str, str]] = SPECIAL_TOKEN_STRINGS

    begin_of_text: int
    end_of_text: int
    start_header: int
    end_header: int
    eot: int
    eom: int
    audio_bos: int
    audio_eos: int
    audio_out_bos: int
    audio_in: int
    audio_out: int
    scene_desc_start: int
    scene_desc_end: int

    @classmethod
    def llama3_layout(cls) -> SpecialTokens:
        """The released tokenizer's ids (for random-weight full-size models only)."""
        return cls(**_LLAMA3_HIGGS_IDS)


def _normalize_rope_scaling(rope_scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Validate a llama3 rope-scaling dict; returns a fresh dict (or None for plain RoPE)."""
    if rope_scaling is None:
        return None
    scaling = dict(rope_scaling)
    scaling.pop("rope_theta", None)  # transformers 5 keeps theta inside rope_parameters
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ConfigError(f"only llama3 rope scaling is supported, got rope_type={rope_type!r}")
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"llama3 rope_scaling lacks {missing}: {rope_scaling}")
    out: dict[str, Any] = {"rope_type": "llama3"}
    for key in _LLAMA3_ROPE_KEYS:
        value = scaling[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"rope_scaling[{key!r}] must be a positive number, got {value!r}")
        out[key] = value
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ConfigError(f"rope_scaling needs high_freq_factor > low_freq_factor: {rope_scaling}")
    return out


def _rope_from_dict(d: Mapping[str, Any], default_theta: float, where: str = "") -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the v5 `rope_parameters` or the v4 keys.

    Some Higgs text configs carry `rope_theta: null` (sglang-omni's loader notes it): that means
    the architecture's default, `default_theta`. An absent key is an error.
    """
    params = d.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise ConfigError(f"{where}rope_parameters lacks rope_theta: {params}")
        theta = float_field(params, "rope_theta", f"{where}rope_parameters.", default_theta)
        return theta, _normalize_rope_scaling(params)
    if "rope_theta" not in d:
        raise ConfigError(f"{where.rstrip('.') or 'config'} has neither rope_parameters nor rope_theta")
    scaling = dict_field(d, "rope_scaling", where, None)
    return float_field(d, "rope_theta", where, default_theta), _normalize_rope_scaling(scaling)


@dataclass(frozen=True)
class TalkerConfig(BackboneConfig):
    """Validated architecture of the Higgs Audio v2 talker (a Llama-3 backbone with DualFFN)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict[str, Any] | None = None
    num_codebooks: int = 8
    codebook_size: int = 1024
    audio_stream_bos_id: int = 1024
    audio_stream_eos_id: int = 1025
    # As config.json says (2048 transformers-native, 131072 original, same model): recorded, not a
    # limit; the serving context cap is EngineConfig.max_seq_len (see talker.py).
    max_position_embeddings: int = 131072
    special: SpecialTokens | None = field(default=None)

    def __post_init__(self) -> None:
        self.validate_backbone()
        object.__setattr__(self, "rope_scaling", _normalize_rope_scaling(self.rope_scaling))

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> TalkerConfig:
        """From the transformers-native config.json (model_type "higgs_audio_v2")."""
        if d.get("model_type", "higgs_audio_v2") != "higgs_audio_v2":
            raise ConfigError(f"expected model_type 'higgs_audio_v2', got {d.get('model_type')!r}")
        if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError("only silu activations without attention/mlp biases are supported")
        rows = int_field(d, "codebook_size", lo=3)  # embedding rows per codebook (1026)
        bos = int_field(d, "audio_stream_bos_id", default=1024, lo=0)
        eos = int_field(d, "audio_stream_eos_id", default=1025, lo=0)
        if rows != eos + 1 or bos != rows - 2:
            raise ConfigError(
                f"transformers-native codebook_size counts embedding rows per codebook and must be "
                f"codes+2 with BOS/EOS at the end (1026 for the released model); got codebook_size={rows} "
                f"with audio_stream_bos_id={bos}, audio_stream_eos_id={eos}"
            )
        dims = backbone_dims(d, "")
        vocab = dims["vocab_size"]
        hf_token_ids(d, "", vocab)
        for key in HF_TEXT_ID_KEYS:
            token_id_field(d, key, vocab=vocab)
        dtype_fields(d)
        theta, scaling = _rope_from_dict(d, cls.rope_theta)
        num_codebooks = int_field(d, "num_codebooks", default=8)
        return cls(
            **dims,
            rms_norm_eps=float_field(d, "rms_norm_eps", default=1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            num_codebooks=num_codebooks,
            codebook_size=rows - 2,
            audio_stream_bos_id=bos,
            audio_stream_eos_id=eos,
            max_position_embeddings=max_positions_field(d, "", 2048, num_codebooks),
        )

    @classmethod
    def from_original_dict(cls, d: Mapping[str, Any]) -> TalkerConfig:
        """From Boson's original config.json (model_type "higgs_audio", nested Llama text_config)."""
        if d.get("model_type", "higgs_audio") != "higgs_audio":
            raise ConfigError(f"expected model_type 'higgs_audio', got {d.get('model_type')!r}")
        text = dict_field(d, "text_config")
        num_layers = int_field(text, "num_hidden_layers", "text_config.")
        adapter = d.get("audio_adapter_type", "stack")
        dual_layers = d.get("audio_dual_ffn_layers") or []
        if not isinstance(dual_layers, list) or not all(isinstance(i, int) for i in dual_layers):
            raise ConfigError(f"audio_dual_ffn_layers must be a list of layer indices, got {dual_layers!r}")
        dual_layers = sorted(dual_layers)
        # compared without building range(num_layers): the layer count is not yet checked against the files
        every_layer = len(dual_layers) == num_layers and dual_layers == list(range(len(dual_layers)))
        if adapter not in ("dual_ffn", "dual_ffn_fast_forward") or not every_layer:
            raise ConfigError(
                f"only all-DualFFN talkers are supported (audio_adapter_type dual_ffn*, every layer in "
                f"audio_dual_ffn_layers); got {adapter!r} with layers {dual_layers[:8]}"
                f"{' ...' if len(dual_layers) > 8 else ''} for num_hidden_layers={num_layers}"
            )
        unsupported = {
            k: d.get(k) for k in ("use_audio_out_self_attention", "audio_embed_avg", "use_rq_transformer",
                                  "use_audio_out_embed_projector", "encode_whisper_embed",
                                  "audio_decoder_proj_num_layers")
            if d.get(k)
        }
        if unsupported:
            raise ConfigError(f"unsupported original-config options enabled: {unsupported}")
        if text.get("hidden_act", "silu") != "silu" or text.get("attention_bias") or text.get("mlp_bias"):
            raise ConfigError("only silu activations without attention/mlp biases are supported")
        dims = backbone_dims(text, "text_config.")
        vocab = dims["vocab_size"]
        hf_token_ids(text, "text_config.", vocab, "text_config.vocab_size")
        for key in ORIGINAL_TEXT_ID_KEYS:
            token_id_field(d, key, vocab=vocab, table="text_config.vocab_size")
        dtype_fields(d)
        dtype_fields(text, "text_config.")
        theta, scaling = _rope_from_dict(text, cls.rope_theta, "text_config.")
        num_codebooks = int_field(d, "audio_num_codebooks", default=12)
        return cls(
            **dims,
            rms_norm_eps=float_field(text, "rms_norm_eps", "text_config.", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            num_codebooks=num_codebooks,
            codebook_size=int_field(d, "audio_codebook_size", default=1024),
            audio_stream_bos_id=int_field(d, "audio_stream_bos_id", default=1024, lo=0),
            audio_stream_eos_id=int_field(d, "audio_stream_eos_id", default=1025, lo=0),
            max_position_embeddings=max_positions_field(text, "text_config.", 131072, num_codebooks),
        )

    @classmethod
    def tiny(cls, **overrides: Any) -> TalkerConfig:
        """A small random-weight talker for CPU tests (special ids at the top of a 300-token vocab)."""
        base: dict[str, Any] = dict(
            vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=dict(LLAMA3_ROPE_SCALING),
            max_position_embeddings=131072, special=SpecialTokens.consecutive(256),
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def full(cls, **overrides: Any) -> TalkerConfig:
        """The released 3B architecture (higgs-audio-v2-generation-3B-base)."""
        base: dict[str, Any] = dict(
            vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24,
            num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=dict(LLAMA3_ROPE_SCALING),
            max_position_embeddings=131072, special=SpecialTokens.llama3_layout(),
        )
        base.update(overrides)
        return cls(**base)

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for transformers' `HiggsAudioV2Config` describing this architecture.

        Special ids present in that config are filled from `special` when it is set.
        """
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        d: dict[str, Any] = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings, num_codebooks=self.num_codebooks,
            codebook_size=self.audio_vocab, audio_stream_bos_id=self.audio_stream_bos_id,
            audio_stream_eos_id=self.audio_stream_eos_id, tie_word_embeddings=False,
        )
        if self.special is not None:
            s = self.special
            d.update(audio_token_id=s.audio_out, audio_bos_token_id=s.audio_out_bos,
                     eos_token_id=s.eot, pad_token_id=s.end_of_text, bos_token_id=s.begin_of_text)
        return d

