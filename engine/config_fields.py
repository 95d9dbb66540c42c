"""Strict typed readers for config.json fields, shared by every family's config and the codecs'.

A JSON int field must be an int (not a bool, a string or a float, not even 64.0), a float field a
real number (an int is fine), a mapping a JSON object, a flag true or false, a token id an int
indexing its table ([0, vocab)), a dtype one the loaders can read. Each reader raises ConfigError
naming the field by its dotted path (`text_config.num_hidden_layers`) and the allowed range; the
loaders prefix the file. A null value counts as absent: the default applies, and a required field
without one is an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from higgs_stream.engine.errors import ConfigError

MAX_INT = 2**31 - 1  # no size, count or id of a real checkpoint comes near it
REQUIRED: Any = object()  # the default of a field that must be present

# What config.json's `dtype` (transformers >= 4.56) or `torch_dtype` may claim: the float types the
# loaders read (engine/checkpoint_files.py reads F32, F16 and BF16 tensors only, and casts them to the
# serving dtype). Anything else (`int3`, `float8_e4m3fn`) is a file this project cannot load.
CONFIG_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_KEYS = ("dtype", "torch_dtype")
# transformers' ids in a config or generation config (`eos_token_id` may be a list of ids)
HF_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _value(d: Mapping[str, Any], key: str, where: str, default: Any) -> tuple[Any, bool]:
    """(value, given): `default` when the key is absent or null; ConfigError when it is required."""
    value = d.get(key)
    if value is not None:
        return value, True
    if default is REQUIRED:
        raise ConfigError(f"{where}{key} is required")
    return default, False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_field(d: Mapping[str, Any], key: str, where: str = "", default: Any = REQUIRED, *,
              lo: int | None = 1, hi: int = MAX_INT, why: str = "") -> int:
    """d[key] as an int in [lo, hi] (lo None: no lower bound); `where` is the path prefix, e.g. "text_config.";
    `why`, when given, follows the range in the message (what the bound is for)."""
    value, given = _value(d, key, where, default)
    if not given:
        return value
    if not _is_int(value):
        raise ConfigError(f"{where}{key} must be an int, got {value!r}")
    if (lo is not None and value < lo) or value > hi:
        bound = f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise ConfigError(f"{where}{key} must be an int {bound}{f' ({why})' if why else ''}, got {value}")
    return value


def float_field(d: Mapping[str, Any], key: str, where: str = "", default: Any = REQUIRED, *,
                positive: bool = True, hi: float | None = None) -> float:
    """d[key] as a finite float (an int is accepted), > 0 unless `positive` is False, <= `hi` when given."""
    value, given = _value(d, key, where, default)
    if not given:
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{where}{key} must be a number, got {value!r}")
    if hi is None and positive and value <= 0:
        raise ConfigError(f"{where}{key} must be > 0, got {value}")
    if hi is not None and ((positive and value <= 0) or value > hi):
        raise ConfigError(f"{where}{key} must be a number {f'in (0, {hi}]' if positive else f'<= {hi}'}, got {value}")
    return float(value)


def bool_field(d: Mapping[str, Any], key: str, where: str = "", default: Any = REQUIRED) -> bool:
    """d[key], which must be JSON true or false (not 0, 1 or "true")."""
    value, given = _value(d, key, where, default)
    if given and not isinstance(value, bool):
        raise ConfigError(f"{where}{key} must be true or false, got {value!r}")
    return value


def token_id_field(d: Mapping[str, Any], key: str, where: str = "", default: Any = None, *, vocab: int,
                   table: str = "vocab_size", many: bool = False) -> Any:
    """d[key] as a token id: an int in [0, vocab), a row of the table it indexes (`table` names the config field
    that sizes it, e.g. "text_config.vocab_size"); `many`: also a non-empty list of such ids (transformers'
    `eos_token_id`), returned as a tuple. Absent or null: `default` (None unless given)."""
    value, given = _value(d, key, where, default)
    if not given:
        return value
    ids = value if many and isinstance(value, list) else [value]
    if not ids or not all(map(_is_int, ids)):
        raise ConfigError(f"{where}{key} must be an int{' or a non-empty list of ints' if many else ''}, got {value!r}")
    if not all(0 <= v < vocab for v in ids):
        raise ConfigError(f"{where}{key} must be a token id in [0, {vocab}) ({table} is {vocab}), got {value!r}")
    return tuple(value) if isinstance(value, list) else value


def hf_token_ids(d: Mapping[str, Any], where: str, vocab: int, table: str = "vocab_size") -> None:
    """transformers' `bos_token_id`, `eos_token_id` (an id or a list of ids) and `pad_token_id` of a config or
    generation config, each when present: ids of the table of `vocab` rows (see `token_id_field`)."""
    for key in HF_TOKEN_ID_KEYS:
        token_id_field(d, key, where, vocab=vocab, table=table, many=key == "eos_token_id")


def dtype_fields(d: Mapping[str, Any], where: str = "") -> None:
    """config.json's `dtype` and `torch_dtype` (either, both or neither may be present): one of CONFIG_DTYPES.
    The loaders cast to the serving dtype, but a file claiming a type they cannot read is not a checkpoint of ours."""
    for key in DTYPE_KEYS:
        value, given = _value(d, key, where, None)
        if given and value not in CONFIG_DTYPES:
            raise ConfigError(f"{where}{key} must be one of {', '.join(CONFIG_DTYPES)}, got {value!r}")


def dict_field(d: Mapping[str, Any], key: str, where: str = "", default: Any = REQUIRED) -> dict[str, Any]:
    """d[key], which must be a JSON object."""
    value, given = _value(d, key, where, default)
    if given and not isinstance(value, dict):
        raise ConfigError(f"{where}{key} must be a JSON object, got {value!r}")
    return value


def int_list_field(d: Mapping[str, Any], key: str, where: str = "", default: Any = REQUIRED, *,
                   lo: int = 1) -> tuple[int, ...]:
    """d[key] as a non-empty list of ints >= lo."""
    value, given = _value(d, key, where, default)
    if not given:
        return tuple(value)
    if not isinstance(value, (list, tuple)) or not value or \
            not all(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= MAX_INT for v in value):
        raise ConfigError(f"{where}{key} must be a non-empty list of ints >= {lo}, got {value!r}")
    return tuple(value)
