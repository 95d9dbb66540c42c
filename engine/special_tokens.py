"""What every family's special-token dataclass shares: checking the ids and filling them from a tokenizer.

A family declares its ids as a frozen dataclass that subclasses `SpecialTokenIds` (one int field per
token, `int | None = None` for an optional one) and sets the class attributes that hold its facts:
`TOKEN_STRINGS` (field -> token string, as engine/tokenizer.py resolves them), `OPTIONAL` (fields a
tokenizer may lack) and `LABEL` (how errors name its tokens). The token strings, the presets' ids and
any derived ids (e.g. the stop ids) stay in the family's config.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from higgs_stream.engine.errors import ConfigError

T = TypeVar("T", bound="SpecialTokenIds")


class SpecialTokenIds:
    """Validation and constructors of a family's special-token ids (subclasses are frozen dataclasses)."""

    TOKEN_STRINGS: ClassVar[Mapping[str, str]]  # field -> token string
    OPTIONAL: ClassVar[tuple[str, ...]] = ()  # fields that may be absent (None)
    LABEL: ClassVar[str] = "special token"  # how error messages name one of these tokens

    def __post_init__(self) -> None:
        ids = self.as_dict()
        for name, value in ids.items():
            if value is None and name in self.OPTIONAL:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{self.LABEL} {name} must be a non-negative int, got {value!r}")
        present = [v for v in ids.values() if v is not None]
        if len(set(present)) != len(present):
            raise ConfigError(f"{self.LABEL} ids must be distinct, got {ids}")

    def as_dict(self) -> dict[str, Any]:
        """Field -> id (None for an absent optional token), in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_lookup(cls: type[T], lookup: Callable[[str], int | None]) -> T:
        """Build from a token-string -> id function (e.g. a tokenizer's `token_to_id`).

        `lookup` must raise (typically CheckpointError) or return None for an unknown token; None
        for a required token becomes a ConfigError naming it.
        """
        ids: dict[str, int | None] = {}
        for name, token in cls.TOKEN_STRINGS.items():
            value = lookup(token)
            if value is None and name not in cls.OPTIONAL:
                raise ConfigError(f"tokenizer has no {cls.LABEL} {token} ({name})")
            ids[name] = None if value is None else int(value)
        return cls(**ids)

    @classmethod
    def consecutive(cls: type[T], first_id: int) -> T:
        """Ids first_id, first_id+1, ... in TOKEN_STRINGS order (for tiny random test models)."""
        return cls(**{name: first_id + i for i, name in enumerate(cls.TOKEN_STRINGS)})
