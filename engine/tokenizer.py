"""Text tokenizer of a Higgs checkpoint: `tokenizer.json` through the `tokenizers` library.

Special token ids are looked up by their token string in the checkpoint's own tokenizer (never
hard-coded), and every token the prompt builder needs must exist as an added token, so that the
literal text `<|AUDIO_OUT|>` inside a prompt piece encodes to exactly one id. REF tokenizes
each prompt piece with `encode(piece, add_special_tokens=False)`; `encode` does the same.

Which tokens are resolved is the model family's: `specials` is the family's dataclass of ids to
fill (each family's config.py, on engine/special_tokens.py's `SpecialTokenIds`), whose class
attributes name each field's token string (`TOKEN_STRINGS`) and the fields that may be absent
(`OPTIONAL`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

from tokenizers import Tokenizer

from higgs_stream.engine.errors import CheckpointError, ConfigError, InvalidInputError

TOKENIZER_FILE = "tokenizer.json"

# Sound-event tags of the Higgs tokenizer (research/higgs_v2_reference.md §3.1). Optional: only
# text normalization emits them, so a tokenizer without them still loads.
SOUND_EVENT_TOKENS = ("<SE>", "</SE>", "<SE_s>", "</SE_s>", "<SE_e>", "</SE_e>")


class SpecialIds(Protocol):
    """A family's special-token dataclass: built from field -> id keyword arguments."""

    TOKEN_STRINGS: ClassVar[Mapping[str, str]]  # field -> token string
    OPTIONAL: ClassVar[tuple[str, ...]]  # fields that may be absent (None)

    def __init__(self, **ids: Any) -> None: ...


Specials = type[SpecialIds]


class TextTokenizer:
    """Byte-level BPE text tokenizer plus the resolved special token ids of one model family."""

    def __init__(self, tokenizer: Tokenizer, source: str = "<memory>", *, specials: Specials) -> None:
        self._tok = tokenizer
        self.source = source
        # Added (special) tokens by string; these are what a prompt may spell literally.
        self._added: dict[str, int] = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        ids = {field: self._require_added(token, optional=field in specials.OPTIONAL)
               for field, token in specials.TOKEN_STRINGS.items()}
        try:
            self.special: Any = specials(**ids)
        except ConfigError as e:
            raise CheckpointError(f"tokenizer {source}: {e}") from e
        # A second instance that treats special-token strings in the input as plain text.
        self._literal = Tokenizer.from_str(tokenizer.to_str())
        self._literal.encode_special_tokens = True

    @classmethod
    def from_dir(cls, path: str | Path, specials: Specials) -> TextTokenizer:
        """Load `<path>/tokenizer.json`; CheckpointError when it is missing, unreadable or incomplete."""
        file = Path(path) / TOKENIZER_FILE
        if not file.is_file():
            raise CheckpointError(f"missing {TOKENIZER_FILE} in {path}")
        return cls.from_file(file, specials)

    @classmethod
    def from_file(cls, file: str | Path, specials: Specials) -> TextTokenizer:
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
            raise CheckpointError(f"cannot read tokenizer {file}: {e}") from e
        return cls(tok, source=str(file), specials=specials)

    def _require_added(self, token: str, optional: bool = False) -> int | None:
        if token not in self._added:
            if optional:
                return None
            in_vocab = self._tok.token_to_id(token)
            detail = (f" (it is in the vocabulary as id {in_vocab} but not an added special token)"
                      if in_vocab is not None else "")
            raise CheckpointError(f"tokenizer {self.source} lacks the Higgs special token {token}{detail}")
        return self._added[token]

    # ----- lookups -----
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the talker's text vocab must be at least this)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        """Id of one token string (e.g. "<|eot_id|>", "<SE>"); CheckpointError when absent."""
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise CheckpointError(f"tokenizer {self.source} has no token {token!r}")
        return tid

    def is_special(self, token_id: int) -> bool:
        return self._tok.id_to_token(token_id) in self._added

    # ----- text <-> ids -----
    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Ids of `text`, no BOS or other template tokens added.

        parse_special=True (REF behaviour) maps special-token strings in the text to their ids
        (`<SE>[Laughter]</SE>`); False encodes them as plain characters (for untrusted user text).
        """
        tok = self._tok if parse_special else self._literal
        return tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidInputError(f"token ids outside the tokenizer vocabulary ({self.vocab_size}): {bad[:8]}")
        return self._tok.decode(ids, skip_special_tokens=skip_special)
