"""TextTokenizer over tokenizer.json: round trips, special ids by string, validation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from higgs_stream.engine.errors import CheckpointError, InvalidInputError
from higgs_stream.engine.models.higgs_v2.config import SPECIAL_TOKEN_STRINGS, SpecialTokens
from higgs_stream.engine.models.higgs_v2.make_checkpoint import build_text_tokenizer, special_ids, write_tokenizer
from higgs_stream.engine.tokenizer import SOUND_EVENT_TOKENS, TextTokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 512)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(tok_dir, SpecialTokens)


TEXTS = [
    "Hello world.",
    "It's 21 degrees; call 555-0142 at 5:30 pm!",
    "  leading and trailing spaces  \n\nnew lines\ttabs",
    "Unicode: café, naïve, 中文, 日本語, emoji 🎙️🔊",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < 512 for i in ids), "plain text must only use BPE ids"
    assert tok.decode(ids) == text


def test_bpe_merges_are_real(tok: TextTokenizer) -> None:
    # Trained merges: common words are single tokens, fewer ids than bytes.
    assert len(tok.encode(" the")) == 1 and len(tok.encode(" and")) == 1
    text = "The quick brown fox jumps over the lazy dog"
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_special_ids_resolved_from_tokenizer(tok: TextTokenizer) -> None:
    assert tok.special == special_ids(512)
    assert tok.special.begin_of_text == 512 and tok.special.audio_out_bos == 525 and tok.special.audio_out == 528
    for field, token in SPECIAL_TOKEN_STRINGS.items():
        assert tok.token_id(token) == getattr(tok.special, field)
        assert tok.is_special(tok.token_id(token))
    assert [tok.token_id(t) for t in SOUND_EVENT_TOKENS] == list(range(512 + 22, 512 + 28))
    assert tok.vocab_size == 768


def test_full_size_tokenizer_uses_the_released_ids() -> None:
    full = TextTokenizer(build_text_tokenizer(128000), specials=SpecialTokens)
    assert full.special == SpecialTokens.llama3_layout()
    assert full.vocab_size == 128256
    assert full.token_id("<|reserved_special_token_6|>") == 128014
    assert full.token_id("<|reserved_special_token_247|>") == 128255
    assert full.token_id("<SE_s>") == 128024
    text = "Hello world, <SE>[Laughter]</SE> it's fine."
    assert full.decode(full.encode(text)) == text


def test_encode_adds_no_bos_and_parses_specials(tok: TextTokenizer) -> None:
    s = tok.special
    ids = tok.encode("<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>")
    assert ids == [s.audio_out_bos, s.audio_out, s.audio_eos]
    ids = tok.encode("<SE>[Laughter]</SE>")
    assert ids[0] == tok.token_id("<SE>") and ids[-1] == tok.token_id("</SE>")
    assert s.begin_of_text not in tok.encode("hi")


def test_literal_mode_keeps_special_strings_as_text(tok: TextTokenizer) -> None:
    text = "say <|eot_id|> please"
    ids = tok.encode(text, parse_special=False)
    assert all(i < 512 for i in ids)
    assert tok.decode(ids) == text
    assert tok.special.eot in tok.encode(text)


def test_decode_skip_special(tok: TextTokenizer) -> None:
    ids = tok.encode("<|begin_of_text|>Hello<|eot_id|>")
    assert tok.decode(ids) == "<|begin_of_text|>Hello<|eot_id|>"
    assert tok.decode(ids, skip_special=True) == "Hello"


def test_token_id_unknown_raises(tok: TextTokenizer) -> None:
    with pytest.raises(CheckpointError, match=r"<\|nope\|>"):
        tok.token_id("<|nope|>")


def test_decode_out_of_range_raises(tok: TextTokenizer) -> None:
    with pytest.raises(InvalidInputError, match="outside"):
        tok.decode([1, 768])


def _tokenizer_without(tok_dir: Path, token: str, tmp_path: Path, keep_in_vocab: bool = False) -> Path:
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != token]
    if keep_in_vocab:  # the string exists as a plain BPE entry, not as an added token
        vocab = spec["model"]["vocab"]
        last = max(vocab, key=vocab.get)  # rename the last BPE entry (no merge produces it whole)
        vocab[token] = vocab.pop(last)
        spec["model"]["merges"] = [m for m in spec["model"]["merges"] if "".join(m) != last]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return tmp_path


@pytest.mark.parametrize("token", ["<|AUDIO_OUT|>", "<|audio_out_bos|>", "<|scene_desc_end|>", "<|eot_id|>"])
def test_missing_special_token_is_named(tok_dir: Path, tmp_path: Path, token: str) -> None:
    d = _tokenizer_without(tok_dir, token, tmp_path)
    with pytest.raises(CheckpointError, match="lacks the Higgs special token " + re.escape(token)):
        TextTokenizer.from_dir(d, SpecialTokens)


def test_special_token_only_in_vocab_is_rejected(tok_dir: Path, tmp_path: Path) -> None:
    d = _tokenizer_without(tok_dir, "<|AUDIO|>", tmp_path, keep_in_vocab=True)
    assert Tokenizer.from_file(str(d / "tokenizer.json")).token_to_id("<|AUDIO|>") is not None
    with pytest.raises(CheckpointError, match="not an added special token"):
        TextTokenizer.from_dir(d, SpecialTokens)


def test_missing_or_corrupt_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing tokenizer.json"):
        TextTokenizer.from_dir(tmp_path, SpecialTokens)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read tokenizer"):
        TextTokenizer.from_dir(tmp_path, SpecialTokens)


def test_transformers_reads_the_same_tokenizer(tok_dir: Path, tok: TextTokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    for text in TEXTS + ["<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"]:
        assert hf(text, add_special_tokens=False).input_ids == tok.encode(text)
    for field, token in SPECIAL_TOKEN_STRINGS.items():
        assert hf.convert_tokens_to_ids(token) == getattr(tok.special, field)
    assert hf.bos_token_id == tok.special.begin_of_text and hf.eos_token_id == tok.special.end_of_text
    assert hf("Hi").input_ids[0] == tok.special.begin_of_text  # template BOS only when asked for
