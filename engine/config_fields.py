"""Strict typed readers for config.json fields, shared by every family's config and the codecs'.

A JSON int field must be an int (not a bool, a string or a float, not even 64.0), a float field a
real number (an int is fine), a mapping a JSON object. Each reader raises ConfigError naming the
field by its dotted path (`text_config.num_hidden_layers`); the loaders prefix the file. A null
value counts as absent: the default applies, and a required field without one is an error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from higgs_stream.engine.errors import ConfigError

MAX_INT = 2**31 - 1  # no size, count or id of a real checkpoint comes near it
REQUIRED: Any = object()  # the default of a field that must be present


def _value(d: Mapping[str, Any], key: str, where: str, default: Any) -> tuple[Any, bool]:
    """(value, given): `default` when the key is absent or null; ConfigError when it is required."""
    value = d.get(key)
    if value is not None:
        return value, True
    if default is REQUIRED:
        raise ConfigError(f"{where}{key} is required")
    return default, False


def int_field(d: Mapping[str, Any], key: str, where: str = "", default: Any = REQUIRED, *,
              lo: int | None = 1, hi: int = MAX_INT) -> int:
    """d[key] as an int in [lo, hi] (lo None: no lower bound); `where` is the path prefix, e.g. "text_config."."""
    value, given = _value(d, key, where, default)
    if not given:
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{where}{key} must be an int, got {value!r}")
    if (lo is not None and value < lo) or value > hi:
        bound = f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
        raise ConfigError(f"{where}{key} must be an int {bound}, got {value}")
    return value


def float_field(d: Mapping[str, Any], key: str, where: str = "", default: Any = REQUIRED, *,
                positive: bool = True) -> float:
    """d[key] as a finite float (an int is accepted), > 0 unless `positive` is False."""
    value, given = _value(d, key, where, default)
    if not given:
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(f"{where}{key} must be a number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{where}{key} must be > 0, got {value}")
    return float(value)


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
