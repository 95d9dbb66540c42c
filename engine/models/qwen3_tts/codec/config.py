"""The 12 Hz tokenizer's decoder configuration (`speech_tokenizer/config.json`, model_type
`qwen3_tts_tokenizer_12hz`): 16 codebooks x 2048 codes, 1920 samples per 80 ms frame at 24 kHz.

Field names are the checkpoint's `decoder_config` names; `QwenCodecConfig.from_json` reads the
whole file (the encoder part is a transformers `MimiConfig`, kept as a dict here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from higgs_stream.engine.config_fields import (
    dict_field,
    dtype_fields,
    float_field,
    int_field,
    int_list_field,
)
from higgs_stream.engine.errors import CheckpointError, ConfigError

MODEL_TYPE = "qwen3_tts_tokenizer_12hz"


@dataclass(frozen=True)
class QwenCodecConfig:
    codebook_size: int = 2048
    codebook_dim: int = 512  # the quantizer's output channels (each codebook holds codebook_dim // 2)
    num_quantizers: int = 16  # 1 semantic + 15 acoustic
    latent_dim: int = 1024
    hidden_size: int = 512  # the pre-transformer
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64
    intermediate_size: int = 1024
    sliding_window: int = 72  # keys per query, the query's own included
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    upsampling_ratios: tuple[int, ...] = (2, 2)  # ConvTranspose(k = stride) + ConvNeXt, before the decoder
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)  # the decoder blocks' ConvTranspose(k = 2 stride)
    decoder_dim: int = 1536
    sample_rate: int = 24000
    encoder: dict[str, Any] = field(default_factory=dict, compare=False)  # MimiConfig fields (encode)
    encoder_valid_num_quantizers: int = 16

    def __post_init__(self) -> None:
        for name in ("codebook_size", "codebook_dim", "num_quantizers", "latent_dim", "hidden_size",
                     "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "sliding_window", "decoder_dim", "sample_rate"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"codec {name} must be a positive int, got {v!r}")
        if self.codebook_dim % 2:
            raise ConfigError(f"codec codebook_dim must be even, got {self.codebook_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("codec num_attention_heads must be a multiple of num_key_value_heads")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ConfigError(f"codec decoder_dim {self.decoder_dim} must halve {len(self.upsample_rates)} times")
        if self.num_quantizers < 2:
            raise ConfigError("codec needs a semantic and at least one acoustic quantizer")

    @property
    def hop(self) -> int:
        """Output samples per frame (the real tokenizer: 2*2*8*5*4*3 = 1920)."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @classmethod
    def from_json(cls, raw: dict[str, Any], source: str = "config.json") -> QwenCodecConfig:
        """From a speech_tokenizer config.json; CheckpointError names a wrong or missing field."""
        if raw.get("model_type") != MODEL_TYPE:
            raise CheckpointError(f"{source}: model_type {raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
        dec = raw.get("decoder_config")
        if not isinstance(dec, dict):
            raise CheckpointError(f"{source}: no decoder_config object")
        names = {f for f in cls.__dataclass_fields__ if f not in ("sample_rate", "encoder",
                                                                  "encoder_valid_num_quantizers")}
        kwargs: dict[str, Any] = {k: dec[k] for k in names if k in dec}
        try:  # typed reads; the ints' ranges are checked when the dataclass is built
            where = "decoder_config."
            dtype_fields(raw)
            if "head_dim" not in dec and "hidden_size" in dec and "num_attention_heads" in dec:
                kwargs["head_dim"] = int_field(dec, "hidden_size", where) // int_field(dec, "num_attention_heads", where)
            for k in ("upsampling_ratios", "upsample_rates"):
                if k in kwargs:
                    kwargs[k] = int_list_field(dec, k, where)
            for k in ("rope_theta", "rms_norm_eps"):
                if k in kwargs:
                    kwargs[k] = float_field(dec, k, where)
            cfg = cls(**kwargs, sample_rate=int_field(raw, "output_sample_rate", "", 24000),
                      encoder=dict_field(raw, "encoder_config", "", {}),
                      encoder_valid_num_quantizers=int_field(raw, "encoder_valid_num_quantizers", "", 16))
        except (ConfigError, TypeError) as e:
            raise CheckpointError(f"{source}: {e}") from e
        upsample = raw.get("decode_upsample_rate", cfg.hop)
        if upsample != cfg.hop:
            raise CheckpointError(f"{source}: decode_upsample_rate {upsample} != the decoder's upsampling {cfg.hop}")
        return cfg

    def to_json(self) -> dict[str, Any]:
        """The speech_tokenizer config.json fields this config holds (what `make_checkpoint` writes)."""
        dec = {f: getattr(self, f) for f in self.__dataclass_fields__
               if f not in ("sample_rate", "encoder", "encoder_valid_num_quantizers")}
        for k in ("upsampling_ratios", "upsample_rates"):
            dec[k] = list(dec[k])
        return {"model_type": MODEL_TYPE, "architectures": ["Qwen3TTSTokenizerV2Model"], "decoder_config": dec,
                "encoder_config": dict(self.encoder), "encoder_valid_num_quantizers": self.encoder_valid_num_quantizers,
                "input_sample_rate": self.sample_rate, "output_sample_rate": self.sample_rate,
                "decode_upsample_rate": self.hop, "encode_downsample_rate": self.hop}


FULL = QwenCodecConfig()  # the released tokenizer's decoder (both talker sizes share it)
