"""The Qwen3-TTS text tokenizer from the hub files (vocab.json + merges.txt + tokenizer_config.json, or
tokenizer.json): ids equal transformers' Qwen2Tokenizer on the same files (the class the reference's
AutoProcessor builds), on make-checkpoint's stand-in vocabularies; typed errors for what is missing
or inconsistent; the checkpoint serves text through the engine."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from higgs_stream.engine.checkpoint_writer import write_checkpoint
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import CheckpointError, ConfigError, InvalidInputError
from higgs_stream.engine.models.qwen3_tts.config import preset
from higgs_stream.engine.models.qwen3_tts.make_checkpoint import write_text_tokenizer
from higgs_stream.engine.models.qwen3_tts.policy import ASSISTANT
from higgs_stream.engine.models.qwen3_tts.tokenizer import TOKENIZER_FILE, QwenTextTokenizer
from higgs_stream.engine.request import GenerationRequest, SamplingParams

ASCII = ["Hello there, how are you?", "It's 12:30 -- OK!!\n\nuser assistant  x", "HelloWorld don't I'll 3.14",
         "  leading and trailing  ", "tabs\tand\r\nnewlines\n", ASSISTANT.format("Say <|im_end|> please.")]
UNICODE = ["café naïve", "cafe\u0301 (decomposed: NFC makes it é)", "其實我真的有發現。", "emoji 🙂 and ß"]


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen") / "tiny", arch="qwen3-tts", preset="tiny", seed=0)


def reference(root):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(root))


def test_ids_equal_transformers_qwen2_tokenizer(qwen_ckpt):
    ours, theirs = QwenTextTokenizer.from_dir(qwen_ckpt), reference(qwen_ckpt)
    assert type(theirs).__name__ == "Qwen2Tokenizer"
    for text in ASCII:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    cfg = preset("tiny")
    assert (ours.special.im_start, ours.special.im_end) == (cfg.im_start_id, cfg.im_end_id)
    ids = ours.encode(ASSISTANT.format("Hi."))
    assert ids[:3] == ids[-3:] and ids[0] == cfg.im_start_id and ids[-5] == cfg.im_end_id  # one token per role
    assert ours.decode(ids) == ASSISTANT.format("Hi.")


def test_a_byte_complete_vocabulary_encodes_any_text(tmp_path):
    """Where the text vocabulary has room for all 256 byte symbols, any text encodes (NFC first)."""
    cfg = replace(preset("tiny"), text_vocab_size=400, tts_pad_id=300, tts_bos_id=301, tts_eos_id=302,
                  im_start_id=303, im_end_id=304)
    write_text_tokenizer(tmp_path, cfg)
    ours, theirs = QwenTextTokenizer.from_dir(tmp_path), reference(tmp_path)
    for text in ASCII + UNICODE:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    assert ours.encode("e\u0301") == ours.encode("é")


def test_the_tiny_vocabulary_refuses_what_it_cannot_spell(qwen_ckpt):
    with pytest.raises(InvalidInputError, match="cannot encode: 'é'"):
        QwenTextTokenizer.from_dir(qwen_ckpt).encode("café")


def test_tokenizer_json_is_read_when_present(qwen_ckpt, tmp_path):
    root = tmp_path / "t"
    shutil.copytree(qwen_ckpt, root, ignore=shutil.ignore_patterns("*.safetensors"))
    (root / TOKENIZER_FILE).write_text(QwenTextTokenizer.from_dir(qwen_ckpt)._tok.to_str())
    for name in ("vocab.json", "merges.txt"):
        (root / name).unlink()
    a, b = QwenTextTokenizer.from_dir(root), QwenTextTokenizer.from_dir(qwen_ckpt)
    assert a.source.endswith(TOKENIZER_FILE) and all(a.encode(t) == b.encode(t) for t in ASCII)


def test_missing_and_inconsistent_files_are_typed(qwen_ckpt, tmp_path):
    root = tmp_path / "t"
    shutil.copytree(qwen_ckpt, root, ignore=shutil.ignore_patterns("*.safetensors", "speech_tokenizer"))
    (root / "merges.txt").unlink()
    with pytest.raises(CheckpointError, match="no text tokenizer: missing merges.txt"):
        QwenTextTokenizer.from_dir(root)
    shutil.copy(qwen_ckpt / "merges.txt", root / "merges.txt")
    config = json.loads((root / "tokenizer_config.json").read_text())
    added = config["added_tokens_decoder"]
    added["158"] = added.pop("155")  # <|endoftext|> declared past a gap
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="declares id 158"):
        QwenTextTokenizer.from_dir(root)
    (root / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read the tokenizer files"):
        QwenTextTokenizer.from_dir(root)


def test_the_checkpoint_speaks_text_through_the_engine(qwen_ckpt):
    engine = Engine.from_pretrained(str(qwen_ckpt), config=EngineConfig(kv_pages=64, max_batch=2))
    assert isinstance(engine.tokenizer, QwenTextTokenizer) and engine.policy.speakers == ("aiden", "dylan")
    req = GenerationRequest("Hello there.", sampling=SamplingParams(temperature=0.0), max_frames=5)
    frames = engine.generate(req)
    assert frames.shape[0] == 16 and 1 <= frames.shape[1] <= 5 and (frames < 64).all()
    np.testing.assert_array_equal(engine.generate(req), frames)  # greedy: the same again
    bad = replace(engine.tokenizer.special, im_end=engine.tokenizer.special.im_start)
    engine.tokenizer.special = bad
    with pytest.raises(ConfigError, match="differ from config.json"):
        engine.family.policy(engine.cfg, engine.tokenizer)
