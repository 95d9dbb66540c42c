"""Codec configuration: one validated dataclass, built from either on-disk config.json layout.

Two layouts describe the same xcodec-style codec (research/higgs_v2_reference.md §2):

- transformers-native (`model_type: higgs_audio_v2_tokenizer`): nested `acoustic_model_config` (DAC) and
  `semantic_model_config` (HuBERT); the number of quantizers is derived from `target_bandwidths`.
- Boson's original (`n_filters`, `D`, `ratios`, `bins`, `n_q`, `codebook_dim`, `semantic_techer`, ...).
  The original code hard-codes the DAC encoder width (64), the decoder width (1024) and the HuBERT-base
  semantic model, so the original config.json cannot describe a shrunken codec. For our own tiny test
  checkpoints we add three extension keys (absent from the real file, where the hard-coded values apply):
  `encoder_hidden_size`, `decoder_hidden_size`, `semantic_model_config`.

Caution: `HiggsAudioV2TokenizerConfig()` defaults are NOT the Higgs codec (hop 320, 5 quantizers); the real
one is `CodecConfig.full()`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from higgs_stream.engine.config_fields import (
    dict_field,
    dtype_fields,
    float_field,
    int_field,
    int_list_field,
)
from higgs_stream.engine.errors import ConfigError

# HuBERT-base (`bosonai/hubert_base` / `facebook/hubert-base-ls960` shape); HubertConfig() defaults match it.
# Only these HubertConfig fields change the eval-mode forward; the rest (dropouts, SpecAugment, CTC) do not.
# Masking is always off here (mask_time_prob = mask_feature_prob = 0), so `masked_spec_embed` is never built.
HUBERT_BASE: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "conv_dim": [512] * 7,
    "conv_kernel": [10, 3, 3, 3, 3, 2, 2],
    "conv_stride": [5, 2, 2, 2, 2, 2, 2],
    "num_conv_pos_embeddings": 128,
    "num_conv_pos_embedding_groups": 16,
    "feat_extract_norm": "group",
    "conv_bias": False,
    "do_stable_layer_norm": False,
    "layer_norm_eps": 1e-5,
    "hidden_act": "gelu",
    "feat_extract_activation": "gelu",
    "feat_proj_layer_norm": True,
    "conv_pos_batch_norm": False,
}

HUBERT_TINY: dict[str, Any] = {
    **HUBERT_BASE,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "conv_dim": [16] * 7,
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 2,
}

# Defaults transformers' HiggsAudioV2TokenizerConfig merges under a partial `acoustic_model_config` dict.
_HF_ACOUSTIC_DEFAULTS: dict[str, Any] = {
    "encoder_hidden_size": 64,
    "downsampling_ratios": [8, 5, 4, 2],
    "decoder_hidden_size": 1024,
    "upsampling_ratios": [8, 5, 4, 2],
    "hidden_size": 256,
}

_HF_TOP_DEFAULTS: dict[str, Any] = {
    "target_bandwidths": [0.5, 1, 1.5, 2, 4],
    "sample_rate": 24000,
    "kernel_size": 3,
    "channel_ratios": [1, 1],
    "strides": [1, 1],
    "block_dilations": [1, 1],
    "unit_kernel_size": 3,
    "codebook_size": 1024,
    "codebook_dim": 64,
    "semantic_sample_rate": 16000,
    "downsample_factor": 320,
}

# The 16 kHz HuBERT frame hop (320 samples = 20 ms); fixed by its conv stack, used in the original's rules.
SEMANTIC_HOP = 320


def _ints(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and v > 0 for v in value):
        raise ConfigError(f"codec config: {name} must be a list of positive ints, got {value!r}")
    return tuple(value)


_HUBERT_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "num_conv_pos_embeddings", "num_conv_pos_embedding_groups")
_HUBERT_INT_LISTS = ("conv_dim", "conv_kernel", "conv_stride")


def _hubert_dict(given: Any) -> dict[str, Any]:
    """HuBERT-base defaults overlaid with the inference-relevant fields of a given HubertConfig dict."""
    given = given or {}
    if not isinstance(given, dict):
        raise ConfigError(f"codec config: semantic_model_config must be a JSON object, got {given!r}")
    if given.get("model_type", "hubert") != "hubert":
        raise ConfigError(f"codec config: semantic model type {given['model_type']!r} is not 'hubert'")
    out = {k: (list(given[k]) if isinstance(given.get(k), tuple) else given.get(k, v))
           for k, v in HUBERT_BASE.items()}
    where = "codec config: semantic_model_config."
    for k in _HUBERT_INTS:
        int_field(out, k, where)
    for k in _HUBERT_INT_LISTS:
        int_list_field(out, k, where)
    float_field(out, "layer_norm_eps", where)
    return out


@dataclass(frozen=True)
class CodecConfig:
    sample_rate: int = 24000
    encoder_ratios: tuple[int, ...] = (8, 5, 4, 2, 3)  # DAC encoder strides (downsampling)
    decoder_ratios: tuple[int, ...] = (8, 5, 4, 2, 3)  # DAC decoder strides (upsampling)
    encoder_hidden_size: int = 64  # DAC encoder width after the first conv (doubles per block)
    decoder_hidden_size: int = 1024  # DAC decoder width after the first conv (halves per block)
    acoustic_dim: int = 256  # DAC latent ("D"); fc2 output / decoder input
    codebook_size: int = 1024
    codebook_dim: int = 64
    num_quantizers: int = 8
    semantic_sample_rate: int = 16000
    downsample_factor: int = SEMANTIC_HOP
    # semantic encoder (xcodec `semantic_module.Encoder`)
    semantic_kernel_size: int = 3
    semantic_channel_ratios: tuple[int, ...] = (1, 1)
    semantic_strides: tuple[int, ...] = (1, 1)
    semantic_block_dilations: tuple[int, ...] = (1, 1)
    semantic_unit_kernel_size: int = 3
    semantic_model: dict[str, Any] = field(default_factory=lambda: dict(HUBERT_BASE))

    def __post_init__(self) -> None:
        for name in ("sample_rate", "encoder_hidden_size", "decoder_hidden_size", "acoustic_dim", "codebook_size",
                     "codebook_dim", "num_quantizers", "semantic_sample_rate", "downsample_factor",
                     "semantic_kernel_size", "semantic_unit_kernel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"codec config: {name} must be a positive int, got {v!r}")
        for name in ("encoder_ratios", "decoder_ratios", "semantic_channel_ratios", "semantic_strides",
                     "semantic_block_dilations"):
            object.__setattr__(self, name, _ints(name, getattr(self, name)))
        if math.prod(self.encoder_ratios) != math.prod(self.decoder_ratios):
            raise ConfigError(f"codec config: encoder ratios {self.encoder_ratios} and decoder ratios "
                              f"{self.decoder_ratios} give different hops")
        if self.decoder_hidden_size % (2 ** len(self.decoder_ratios)) != 0:
            raise ConfigError(f"codec config: decoder_hidden_size {self.decoder_hidden_size} must be divisible by "
                              f"2**{len(self.decoder_ratios)}")
        if self.semantic_strides != (1,) * len(self.semantic_strides) or \
                len(self.semantic_channel_ratios) != len(self.semantic_strides):
            raise ConfigError("codec config: only stride-1 semantic blocks with one channel ratio each are supported")
        if not isinstance(self.semantic_model, dict) or not isinstance(self.semantic_model.get("hidden_size"), int):
            raise ConfigError(f"codec config: semantic_model must be a HuBERT config dict with hidden_size, "
                              f"got {self.semantic_model!r}")
        if self.semantic_downsample_factor < 1:
            raise ConfigError(f"codec config: hop {self.hop} at {self.sample_rate} Hz is shorter than two HuBERT frames "
                              f"({self.downsample_factor} at {self.semantic_sample_rate} Hz); not a Higgs codec "
                              f"(its hop is 960)")

    # ---- derived values (never stored) ----
    @property
    def hop(self) -> int:
        return math.prod(self.decoder_ratios)

    @property
    def frame_rate(self) -> int:
        return math.ceil(self.sample_rate / self.hop)

    @property
    def semantic_dim(self) -> int:
        return int(self.semantic_model["hidden_size"])

    @property
    def hidden_size(self) -> int:
        """Quantizer dimension: acoustic latent + semantic features, concatenated."""
        return self.acoustic_dim + self.semantic_dim

    @property
    def semantic_downsample_factor(self) -> int:
        return int(self.hop / (self.sample_rate / self.semantic_sample_rate) / self.downsample_factor)

    @property
    def codebook_nbits(self) -> int:
        return math.ceil(math.log2(self.codebook_size))

    @property
    def receptive_field(self) -> int:
        """Frames of left context (= right lookahead) a latent frame reaches in the decoder output."""
        from higgs_stream.engine.codec.decoder import influence_interval

        f = 1000  # any frame far from both ends
        lo, hi = influence_interval(self, f)
        return max(f - lo // self.hop, hi // self.hop - f)

    # ---- presets ----
    @classmethod
    def full(cls, **overrides: Any) -> CodecConfig:
        """The real `bosonai/higgs-audio-v2-tokenizer` codec (research §2.1)."""
        return replace(cls(), **overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> CodecConfig:
        """Same kernel/stride/dilation structure (hop 960, ±10-frame receptive field), tiny channels."""
        base = cls(encoder_hidden_size=4, decoder_hidden_size=64, acoustic_dim=16,
                   semantic_model=dict(HUBERT_TINY))
        return replace(base, **overrides)

    # ---- transformers-native config.json ----
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> CodecConfig:
        if d.get("model_type") != "higgs_audio_v2_tokenizer":
            raise ConfigError(f"codec config: model_type {d.get('model_type')!r} is not 'higgs_audio_v2_tokenizer'")
        top = {**_HF_TOP_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        ac_in = dict_field(d, "acoustic_model_config", "codec config: ", {})
        ac = {**_HF_ACOUSTIC_DEFAULTS, **{k: v for k, v in ac_in.items() if v is not None}}
        where, ac_where = "codec config: ", "codec config: acoustic_model_config."
        dtype_fields(d, where)
        down = int_list_field(ac, "downsampling_ratios", ac_where)
        # DacConfig semantics: upsampling = reversed downsampling and hidden = enc * 2**n unless given.
        if "upsampling_ratios" not in ac_in and "downsampling_ratios" in ac_in:
            ac["upsampling_ratios"] = list(down)[::-1]
        encoder_hidden = int_field(ac, "encoder_hidden_size", ac_where)
        if "hidden_size" not in ac_in and "encoder_hidden_size" in ac_in:
            ac["hidden_size"] = encoder_hidden * 2 ** len(down)
        sem = _hubert_dict(d.get("semantic_model_config"))
        sample_rate = int_field(top, "sample_rate", where)
        codebook_size = int_field(top, "codebook_size", where, lo=2)
        frame_rate = math.ceil(sample_rate / math.prod(down))
        nbits = math.ceil(math.log2(codebook_size))
        bw = top["target_bandwidths"]
        if not isinstance(bw, list) or not bw or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and b > 0 for b in bw):
            raise ConfigError(f"codec config: target_bandwidths must be a non-empty list of positive numbers, got {bw!r}")
        num_q = int(1000 * bw[-1] // (frame_rate * nbits))
        acoustic_dim = int_field(ac, "hidden_size", ac_where)
        if "codebook_dim" in d and d["codebook_dim"] is None:  # transformers: None means the full hidden size
            codebook_dim = acoustic_dim + sem["hidden_size"]
        else:
            codebook_dim = int_field(top, "codebook_dim", where)
        return cls(
            sample_rate=sample_rate,
            encoder_ratios=down,
            decoder_ratios=int_list_field(ac, "upsampling_ratios", ac_where),
            encoder_hidden_size=encoder_hidden,
            decoder_hidden_size=int_field(ac, "decoder_hidden_size", ac_where),
            acoustic_dim=acoustic_dim,
            codebook_size=codebook_size,
            codebook_dim=codebook_dim,
            num_quantizers=num_q,
            semantic_sample_rate=int_field(top, "semantic_sample_rate", where),
            downsample_factor=int_field(top, "downsample_factor", where),
            semantic_kernel_size=int_field(top, "kernel_size", where),
            semantic_channel_ratios=int_list_field(top, "channel_ratios", where),
            semantic_strides=int_list_field(top, "strides", where),
            semantic_block_dilations=int_list_field(top, "block_dilations", where),
            semantic_unit_kernel_size=int_field(top, "unit_kernel_size", where),
            semantic_model=sem,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """Kwargs for transformers' HiggsAudioV2TokenizerConfig (and what save_pretrained round-trips)."""
        bw = self.num_quantizers * self.frame_rate * self.codebook_nbits / 1000
        return {
            "model_type": "higgs_audio_v2_tokenizer",
            "target_bandwidths": [bw * k / 4 for k in (1, 2, 3, 4)],
            "sample_rate": self.sample_rate,
            "codebook_size": self.codebook_size,
            "codebook_dim": self.codebook_dim,
            "semantic_sample_rate": self.semantic_sample_rate,
            "downsample_factor": self.downsample_factor,
            "kernel_size": self.semantic_kernel_size,
            "channel_ratios": list(self.semantic_channel_ratios),
            "strides": list(self.semantic_strides),
            "block_dilations": list(self.semantic_block_dilations),
            "unit_kernel_size": self.semantic_unit_kernel_size,
            "acoustic_model_config": {
                "encoder_hidden_size": self.encoder_hidden_size,
                "downsampling_ratios": list(self.encoder_ratios),
                "decoder_hidden_size": self.decoder_hidden_size,
                "upsampling_ratios": list(self.decoder_ratios),
                "hidden_size": self.acoustic_dim,
            },
            "semantic_model_config": dict(self.semantic_model),
        }

    # ---- Boson's original config.json ----
    @classmethod
    def from_original_dict(cls, d: dict[str, Any]) -> CodecConfig:
        missing = [k for k in ("D", "ratios", "sample_rate", "bins", "n_q") if k not in d]
        if missing:
            raise ConfigError(f"original codec config: missing keys {missing}")
        if d.get("semantic_techer", "hubert_base_general") not in ("hubert_base_general", "hubert_base"):
            raise ConfigError(f"original codec config: semantic_techer {d['semantic_techer']!r} is not a HuBERT "
                              f"teacher; only hubert_base(_general) is supported")
        if isinstance(d["bins"], list):
            raise ConfigError(f"original codec config: bins {d['bins']!r} (FSQ) is not supported; RVQ only")
        if d.get("vq_scale", 1) != 1 or d.get("downsample_mode", "step_down") != "step_down":
            raise ConfigError("original codec config: only vq_scale=1 and downsample_mode='step_down' are supported")
        if d.get("codebook_dim") is None:
            raise ConfigError("original codec config: codebook_dim is required (no projection-free RVQ)")
        where = "original codec config: "
        ratios = int_list_field(d, "ratios", where)
        sem = _hubert_dict(d.get("semantic_model_config"))
        return cls(
            sample_rate=int_field(d, "sample_rate", where),
            encoder_ratios=ratios,
            decoder_ratios=ratios,
            encoder_hidden_size=int_field(d, "encoder_hidden_size", where, 64),  # hard-coded 64 in the original
            decoder_hidden_size=int_field(d, "decoder_hidden_size", where, 1024),  # hard-coded 1024 in the original
            acoustic_dim=int_field(d, "D", where),
            codebook_size=int_field(d, "bins", where, lo=2),
            codebook_dim=int_field(d, "codebook_dim", where),
            num_quantizers=int_field(d, "n_q", where),
            semantic_sample_rate=int_field(d, "semantic_sample_rate", where, 16000),
            semantic_model=sem,
        )

    def to_original_dict(self) -> dict[str, Any]:
        if self.encoder_ratios != self.decoder_ratios:
            raise ConfigError("original layout needs identical encoder and decoder ratios")
        d: dict[str, Any] = {
            "n_filters": 32,
            "D": self.acoustic_dim,
            "codebook_dim": self.codebook_dim,
            "target_bandwidths": [0.5, 1, 1.5, 2, 4],
            "ratios": list(self.decoder_ratios),
            "sample_rate": self.sample_rate,
            "bins": self.codebook_size,
            "n_q": self.num_quantizers,
            "semantic_techer": "hubert_base_general",
        }
        # Extension keys only where the original's hard-coded values do not hold.
        if self.encoder_hidden_size != 64:
            d["encoder_hidden_size"] = self.encoder_hidden_size
        if self.decoder_hidden_size != 1024:
            d["decoder_hidden_size"] = self.decoder_hidden_size
        if self.semantic_model != HUBERT_BASE:
            d["semantic_model_config"] = dict(self.semantic_model)
        if self.semantic_sample_rate != 16000:
            d["semantic_sample_rate"] = self.semantic_sample_rate
        return d

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
