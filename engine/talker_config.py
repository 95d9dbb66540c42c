"""What every family's talker config shares: the transformer backbone's dimensions and their checks.

Each family's config (`models/<family>/config.py`) is a frozen dataclass that declares the fields
`BackboneConfig` reads (`BACKBONE_INT_FIELDS`, `rms_norm_eps`, `rope_theta`, the stream BOS/EOS ids,
`special`) and calls `validate_backbone()` when built. The engine, the KV cache and the fast path
only read these fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from higgs_stream.engine.config_fields import int_field
from higgs_stream.engine.errors import ConfigError


def positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")


def require_field(d: Mapping[str, Any], key: str, where: str) -> Any:
    """d[key]; a ConfigError naming `where` (e.g. "v3 text_config") when it is missing or null."""
    if d.get(key) is None:
        raise ConfigError(f"{where} lacks required field {key!r}")
    return d[key]


def backbone_dims(d: Mapping[str, Any], where: str) -> dict[str, int]:
    """The backbone dimensions of a transformers-style (Llama, Qwen3) config dict, under our field
    names: vocab, hidden and intermediate size, layers, heads, KV heads (default: heads) and head_dim
    (default: hidden // heads). ConfigError naming the field (under the path prefix `where`, e.g.
    "text_config.") for a missing or wrongly typed one (engine/config_fields.py)."""
    hidden = int_field(d, "hidden_size", where)
    heads = int_field(d, "num_attention_heads", where)
    if d.get("head_dim") is None and hidden % heads:  # the derived head_dim would drop hidden % heads channels
        raise ConfigError(f"{where}num_attention_heads ({heads}) must divide {where}hidden_size ({hidden}) when "
                          f"{where}head_dim is not given")
    return dict(
        vocab_size=int_field(d, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=int_field(d, "intermediate_size", where),
        num_layers=int_field(d, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=int_field(d, "num_key_value_heads", where, heads),
        head_dim=int_field(d, "head_dim", where, hidden // heads),
    )


def max_positions_field(d: Mapping[str, Any], where: str, default: int, num_codebooks: int) -> int:
    """config.json's `max_position_embeddings`: recorded, not the serving context cap (EngineConfig.max_seq_len,
    2048 in the transformers-native v2 file that serves 8192), but at least num_codebooks + 2: the fewest
    positions in which one stream speaks one frame (one prompt token, the num_codebooks positions Engine.add
    reserves past the prompt, one frame). Less is a broken file, not a small model."""
    return int_field(d, "max_position_embeddings", where, default, lo=num_codebooks + 2,
                     why=f"one prompt token, the {num_codebooks} positions the engine reserves for the "
                         f"{num_codebooks} codebooks and one frame")


BACKBONE_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                       "head_dim", "num_codebooks", "codebook_size", "max_position_embeddings")


class BackboneConfig:
    """Validation and derived values shared by every family's talker config (frozen dataclasses
    that declare the fields used here)."""

    def validate_backbone(self) -> None:
        """The checks every family shares; normalises `rope_theta` to float. ConfigError on the first violation."""
        for name in BACKBONE_INT_FIELDS:
            positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not (isinstance(self.rms_norm_eps, float) and 0.0 < self.rms_norm_eps < 1.0):
            raise ConfigError(f"rms_norm_eps must be a float in (0, 1), got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1.0):
            raise ConfigError(f"rope_theta must be > 1, got {self.rope_theta!r}")
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        if self.audio_stream_bos_id != self.codebook_size or self.audio_stream_eos_id != self.codebook_size + 1:
            raise ConfigError(
                f"expected stream BOS/EOS (BOC/EOC) ids {self.codebook_size}/{self.codebook_size + 1} right after "
                f"the {self.codebook_size} codes, got {self.audio_stream_bos_id}/{self.audio_stream_eos_id}"
            )
        if self.special is not None:
            too_big = {k: v for k, v in self.special.as_dict().items() if v is not None and v >= self.vocab_size}
            if too_big:
                raise ConfigError(f"special token ids outside vocab_size={self.vocab_size}: {too_big}")

    @property
    def audio_vocab(self) -> int:
        """Per-codebook vocabulary: the codes plus stream BOS and EOS (1026)."""
        return self.codebook_size + 2

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def with_special(self, special: Any) -> Any:
        """A copy with the special token ids set (the loader's last step)."""
        return dataclasses.replace(self, special=special)
