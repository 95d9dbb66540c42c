"""The Qwen3-TTS text tokenizer from a checkpoint directory (the hub layout).

The reference (qwen-tts 0.1.1) loads it with `AutoProcessor.from_pretrained(model, fix_mistral_regex=True)`:
a `Qwen2TokenizerFast` over the repo's `vocab.json`, `merges.txt` and `tokenizer_config.json`
(its `added_tokens_decoder` holds <|im_start|>, <|im_end|>, the TTS tokens, ...), or its
`tokenizer.json` when the repo has one. transformers 4.57.3 builds the fast tokenizer from the
two vocabulary files the way its `Qwen2Converter` does, and so does `from_vocab_files` here:

    byte-level BPE (no unk, no dropout, no byte fallback), NFC normalization,
    pre-tokenizer: Split(Qwen2's regex, isolated) then ByteLevel(add_prefix_space=False, use_regex=False),
    added tokens at the ids tokenizer_config.json gives (they must follow the vocabulary without a gap)

Text is encoded as the reference's processor call does (`tokenizer(text)`): special-token strings
are parsed, nothing is added around the ids (Qwen2 has no BOS).

One reference quirk is not followed: with `fix_mistral_regex=True`, transformers 4.57.3 swaps in
Mistral's pre-tokenizer regex when the tokenizer (vocabulary > 100000) is read from a local
directory whose config.json records a transformers version other than <= 4.57.2 or >= 5.0 (e.g.
4.57.3, or none); loaded by hub id the regex stays Qwen2's. The same checkpoint so tokenizes
differently depending on how the reference was pointed at it (words such as "HelloWorld" split at
the case change under Mistral's). This loader always uses the tokenizer's own (Qwen2) regex, the
hub-id behaviour.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from higgs_stream.engine.errors import CheckpointError, InvalidInputError

VOCAB_FILE, MERGES_FILE, CONFIG_FILE, TOKENIZER_FILE = "vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json"
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (what ByteLevel pre-tokenization maps each byte to)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@dataclass(frozen=True)
class QwenTextSpecial:
    """The chat template's ids, as the tokenizer spells them (checked against config.json's)."""

    im_start: int
    im_end: int


class QwenTextTokenizer:
    def __init__(self, tok: Tokenizer, source: str) -> None:
        self._tok, self.source = tok, source
        ids = {t: tok.token_to_id(t) for t in (IM_START, IM_END)}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise CheckpointError(f"tokenizer {source} lacks {', '.join(missing)}")
        self.special = QwenTextSpecial(ids[IM_START], ids[IM_END])
        vocab = tok.get_vocab(with_added_tokens=False)
        symbols = byte_symbols()
        self._bytes = frozenset(b for b, c in symbols.items() if c in vocab)  # bytes the BPE can spell

    @classmethod
    def from_dir(cls, root: str | Path) -> QwenTextTokenizer:
        """`tokenizer.json` if the directory has one, else vocab.json + merges.txt + tokenizer_config.json;
        CheckpointError naming what is missing or malformed."""
        root = Path(root)
        if (root / TOKENIZER_FILE).is_file():
            try:
                return cls(Tokenizer.from_file(str(root / TOKENIZER_FILE)), str(root / TOKENIZER_FILE))
            except Exception as e:  # the tokenizers library raises a bare Exception on bad JSON
                raise CheckpointError(f"cannot read tokenizer {root / TOKENIZER_FILE}: {e}") from e
        missing = [f for f in (VOCAB_FILE, MERGES_FILE, CONFIG_FILE) if not (root / f).is_file()]
        if missing:
            raise CheckpointError(f"{root} has no text tokenizer: missing {', '.join(missing)} (or {TOKENIZER_FILE})")
        return cls(from_vocab_files(root), str(root))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, special-token strings parsed (the chat template's). InvalidInputError for a
        character the vocabulary cannot spell (only a toy vocabulary lacks some of the 256 bytes)."""
        if len(self._bytes) < 256:
            lost = {c for c in unicodedata.normalize("NFC", text) if not set(c.encode("utf-8")) <= self._bytes}
            if lost:
                raise InvalidInputError(f"text holds characters this tokenizer cannot encode: {''.join(sorted(lost))!r}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def from_vocab_files(root: Path) -> Tokenizer:
    """Qwen2's fast tokenizer from vocab.json, merges.txt and tokenizer_config.json (transformers'
    Qwen2Converter)."""
    try:
        vocab = json.loads((root / VOCAB_FILE).read_text(encoding="utf-8"))
        lines = (root / MERGES_FILE).read_text(encoding="utf-8").splitlines()
        config = json.loads((root / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read the tokenizer files in {root}: {e}") from e
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    bad = [m for m in merges if len(m) != 2]
    if bad:
        raise CheckpointError(f"{root / MERGES_FILE}: a merge must be two symbols, got {' '.join(bad[0])!r}")
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space") or False), use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = config.get("added_tokens_decoder") or {}
    try:
        entries = sorted((int(i), spec) for i, spec in added.items())
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{root / CONFIG_FILE}: added_tokens_decoder keys must be ids: {e}") from e
    for tid, spec in entries:
        _add(tok, tid, spec, root)
    return tok


def _add(tok: Tokenizer, tid: int, spec: dict[str, Any], root: Path) -> None:
    """One added token at its declared id (the tokenizers library gives the next free id)."""
    content = spec.get("content") if isinstance(spec, dict) else None
    if not isinstance(content, str) or not content:
        raise CheckpointError(f"{root / CONFIG_FILE}: added token {tid} has no content")
    token = AddedToken(content, single_word=bool(spec.get("single_word", False)), lstrip=bool(spec.get("lstrip", False)),
                       rstrip=bool(spec.get("rstrip", False)), normalized=bool(spec.get("normalized", False)),
                       special=bool(spec.get("special", False)))
    (tok.add_special_tokens if token.special else tok.add_tokens)([token])
    got = tok.token_to_id(content)
    if got != tid:
        raise CheckpointError(f"{root / CONFIG_FILE}: added token {content!r} declares id {tid}, but follows a "
                              f"vocabulary that gives it {got} (added ids must continue the vocabulary)")
