"""Out-of-range config fields of every family's checkpoint fail at load, naming the file, the field and the range.

Each case edits one file of a tiny checkpoint the project's own writer made (tests/conftest.py: `make-checkpoint
--preset tiny --seed 0`, v2 in both layouts, v3, Qwen3-TTS CustomVoice) and loads it through the registry, as
`serve` and `synth` do: a token id outside the table it indexes, a position table too short to speak one frame, a
dtype the loader cannot read, a head count that does not divide the hidden size, a generation_config.json that is
not JSON or holds a bad value. The unmodified checkpoints still load.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from higgs_stream import cli
from higgs_stream.engine.checkpoint_files import _FLOAT_DTYPES
from higgs_stream.engine.config_fields import CONFIG_DTYPES
from higgs_stream.engine.errors import CheckpointError
from higgs_stream.engine.models.registry import load_codec_for, load_model

DELETE: Any = object()  # an edit's value that removes the field
# the fixture of each family's tiny checkpoint (tests/conftest.py)
FIXTURES = {"v2": "tiny_ckpt", "v2-original": "tiny_ckpt_original", "v3": "tiny_v3_ckpt", "qwen3-tts": "tiny_qwen_ckpt"}
TOKEN = r"must be a token id in \[0, {n}\) \({table} is {n}\), got "
V2_VOCAB = TOKEN.format(n=768, table="vocab_size")
V2_TEXT_VOCAB = TOKEN.format(n=768, table="text_config.vocab_size")
V3_TEXT_VOCAB = TOKEN.format(n=300, table="text_config.vocab_size")
QWEN_TEXT_VOCAB = TOKEN.format(n=160, table=r"talker_config.text_vocab_size")
DTYPE = "must be one of float32, float16, bfloat16, got "


def positions(k: int) -> str:
    """The message of a max_position_embeddings below num_codebooks + 2 (k codebooks)."""
    return rf"must be an int in \[{k + 2}, 2147483647\] \(one prompt token, the {k} positions the engine reserves"


def copy_of(request: pytest.FixtureRequest, family: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(request.getfixturevalue(FIXTURES[family]), tmp_path / family))


def edit_json(file: Path, edits: dict[str, Any]) -> None:
    """Set each dotted path of `edits` in the JSON object of `file` (DELETE: remove it)."""
    data = json.loads(file.read_text())
    for path, value in edits.items():
        *parents, key = path.split(".")
        node = data
        for p in parents:
            node = node[p]
        if value is DELETE:
            node.pop(key, None)
        else:
            node[key] = value
    file.write_text(json.dumps(data))


def load_fails(root: Path, file: Path, match: str, *, codec: bool = False) -> str:
    """Loading `root` (its codec: `codec`) raises CheckpointError naming `file` and matching `match`."""
    with pytest.raises(CheckpointError) as e:
        load_codec_for(root) if codec else load_model(root)
    message = str(e.value)
    assert e.value.code == "checkpoint"
    assert str(file) in message, message
    assert re.search(match, message), message
    return message


# ------------------------------------------------------------------------------------- config.json
@pytest.mark.parametrize("family,edits,match", [
    # Higgs v2, transformers-native: transformers' ids and the audio text ids index the text embedding
    ("v2", {"eos_token_id": 99999}, "eos_token_id " + V2_VOCAB + "99999"),
    ("v2", {"eos_token_id": [521, 768]}, "eos_token_id " + V2_VOCAB + r"\[521, 768\]"),
    ("v2", {"eos_token_id": []}, "eos_token_id must be an int or a non-empty list of ints, got \\[\\]"),
    ("v2", {"bos_token_id": -1}, "bos_token_id " + V2_VOCAB + "-1"),
    ("v2", {"pad_token_id": "513"}, "pad_token_id must be an int, got '513'"),
    ("v2", {"audio_delay_token_id": 768}, "audio_delay_token_id " + V2_VOCAB + "768"),
    ("v2", {"audio_bos_token_id": 5000}, "audio_bos_token_id " + V2_VOCAB + "5000"),
    ("v2", {"max_position_embeddings": 1}, "max_position_embeddings " + positions(8) + r".*got 1$"),
    ("v2", {"max_position_embeddings": 9}, "max_position_embeddings " + positions(8)),
    ("v2", {"dtype": "int3"}, "dtype " + DTYPE + "'int3'"),
    ("v2", {"torch_dtype": "float64"}, "torch_dtype " + DTYPE + "'float64'"),
    ("v2", {"dtype": 32}, "dtype " + DTYPE + "32"),
    ("v2", {"head_dim": DELETE, "num_attention_heads": 3},
     r"num_attention_heads \(3\) must divide hidden_size \(64\) when head_dim is not given"),
    # Higgs v2, Boson's original layout: the ids of the top level and of the nested Llama text_config
    ("v2-original", {"text_config.eos_token_id": 768}, "text_config.eos_token_id " + V2_TEXT_VOCAB + "768"),
    ("v2-original", {"text_config.bos_token_id": -2}, "text_config.bos_token_id " + V2_TEXT_VOCAB + "-2"),
    ("v2-original", {"audio_in_token_idx": -5}, "audio_in_token_idx " + V2_TEXT_VOCAB + "-5"),
    ("v2-original", {"pad_token_id": 10**6}, "pad_token_id " + V2_TEXT_VOCAB + "1000000"),
    ("v2-original", {"text_config.max_position_embeddings": 2},
     "text_config.max_position_embeddings " + positions(8)),
    ("v2-original", {"text_config.torch_dtype": "int8"}, "text_config.torch_dtype " + DTYPE + "'int8'"),
    ("v2-original", {"torch_dtype": "q4_0"}, "torch_dtype " + DTYPE + "'q4_0'"),
    # Higgs v3: the Qwen3 text_config's ids, the position table, the dtype, the audio placeholder id
    ("v3", {"text_config.bos_token_id": -1}, "text_config.bos_token_id " + V3_TEXT_VOCAB + "-1"),
    ("v3", {"text_config.eos_token_id": 99999}, "text_config.eos_token_id " + V3_TEXT_VOCAB + "99999"),
    ("v3", {"text_config.pad_token_id": 300}, "text_config.pad_token_id " + V3_TEXT_VOCAB + "300"),
    ("v3", {"text_config.max_position_embeddings": 1}, "text_config.max_position_embeddings " + positions(8)),
    ("v3", {"dtype": "int3"}, "dtype " + DTYPE + "'int3'"),
    ("v3", {"text_config.dtype": "float8_e4m3fn"}, "text_config.dtype " + DTYPE + "'float8_e4m3fn'"),
    ("v3", {"audio_token_id": 300}, r"audio_token_id must be an int <= 299 \(negative: none; else an id of the "
                                    r"text_config.vocab_size=300 table\), got 300"),
    ("v3", {"text_config.head_dim": DELETE, "text_config.num_attention_heads": 3},
     r"text_config.num_attention_heads \(3\) must divide text_config.hidden_size \(64\)"),
    # Qwen3-TTS: the text-track ids index the text embedding (talker_config.text_vocab_size rows)
    ("qwen3-tts", {"tts_pad_token_id": 160}, "tts_pad_token_id " + QWEN_TEXT_VOCAB + "160"),
    ("qwen3-tts", {"tts_eos_token_id": 99999}, "tts_eos_token_id " + QWEN_TEXT_VOCAB + "99999"),
    ("qwen3-tts", {"im_end_token_id": -1}, "im_end_token_id " + QWEN_TEXT_VOCAB + "-1"),
    ("qwen3-tts", {"talker_config.max_position_embeddings": 1},
     "talker_config.max_position_embeddings " + positions(16)),
    ("qwen3-tts", {"dtype": "int3"}, "dtype " + DTYPE + "'int3'"),
    ("qwen3-tts", {"talker_config.head_dim": DELETE, "talker_config.num_attention_heads": 3},
     r"talker_config.num_attention_heads \(3\) must divide talker_config.hidden_size \(16\)"),
    ("qwen3-tts", {"talker_config.code_predictor_config.num_key_value_heads": 3},
     r"code predictor heads \(2\) must be a multiple of kv heads \(3\)"),
    ("qwen3-tts", {"talker_config.code_predictor_config.vocab_size": 0},
     r"talker_config.code_predictor_config.vocab_size must be an int in \[1, "),
    ("qwen3-tts", {"talker_config.codec_eos_token_id": 1088}, r"codec special ids must lie in \[64, 1088\)"),
])
def test_out_of_range_config_fields_fail_at_load(request, tmp_path, family, edits, match):
    root = copy_of(request, family, tmp_path)
    edit_json(root / "config.json", edits)
    message = load_fails(root, root / "config.json", match)
    assert message.startswith(f"{root / 'config.json'}: "), message


@pytest.mark.parametrize("family,edits", [
    ("v2", {"max_position_embeddings": 10}),  # num_codebooks + 2: the fewest positions that speak one frame
    ("v2", {"eos_token_id": [521, 767], "torch_dtype": "bfloat16"}),  # transformers' list of stop ids
    ("v3", {"text_config.max_position_embeddings": 10, "audio_token_id": 299}),
    ("qwen3-tts", {"talker_config.max_position_embeddings": 18, "dtype": "float16"}),
])
def test_values_at_the_bounds_load(request, tmp_path, family, edits):
    root = copy_of(request, family, tmp_path)
    edit_json(root / "config.json", edits)
    load_model(root)


# --------------------------------------------------------------------------- generation_config.json
@pytest.mark.parametrize("family,content,match", [
    # not JSON, or not an object: the same CheckpointError as a broken config.json
    ("v2", "nope", r"cannot read .*generation_config.json: not JSON \(Expecting value"),
    ("v2-original", "[1, 2]", r"generation_config.json must hold a JSON object, got list"),
    ("v3", "nope", r"cannot read .*generation_config.json: not JSON"),
    ("qwen3-tts", "nope", r"cannot read .*generation_config.json: not JSON"),
    ("qwen3-tts", "[" * 100_000 + "]" * 100_000, r"generation_config.json: not JSON \(nested too deeply\)"),
])
def test_generation_config_that_is_not_a_json_object_fails(request, tmp_path, family, content, match):
    root = copy_of(request, family, tmp_path)
    (root / "generation_config.json").write_text(content)
    load_fails(root, root / "generation_config.json", match)


@pytest.mark.parametrize("family,edits,match", [
    ("v2", {"eos_token_id": 99999}, "eos_token_id " + TOKEN.format(n=768, table="config.json vocab_size") + "99999"),
    ("v2-original", {"bos_token_id": -1},
     "bos_token_id " + TOKEN.format(n=768, table="config.json text_config.vocab_size") + "-1"),
    ("v3", {"eos_token_id": [293, 300]},
     "eos_token_id " + TOKEN.format(n=300, table="config.json text_config.vocab_size") + r"\[293, 300\]"),
    ("v3", {"pad_token_id": True}, "pad_token_id must be an int, got True"),
    # Qwen3-TTS reads its sampling defaults from the file: each typed and in range
    ("qwen3-tts", {"temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ("qwen3-tts", {"top_p": 1.5}, r"top_p must be a number in \(0, 1.0\], got 1.5"),
    ("qwen3-tts", {"subtalker_top_p": 0}, r"subtalker_top_p must be a number in \(0, 1.0\], got 0"),
    ("qwen3-tts", {"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
    ("qwen3-tts", {"top_k": -1}, r"top_k must be an int in \[0, 2147483647\], got -1"),
    ("qwen3-tts", {"subtalker_dosample": 1}, "subtalker_dosample must be true or false, got 1"),
    ("qwen3-tts", {"max_new_tokens": 0}, r"max_new_tokens must be an int in \[1, "),
])
def test_bad_generation_config_values_fail_naming_the_file(request, tmp_path, family, edits, match):
    root = copy_of(request, family, tmp_path)
    file = root / "generation_config.json"
    edit_json(file, edits)
    message = load_fails(root, file, match)
    assert message.startswith(f"{file}: "), message


def test_generation_config_is_optional(request, tmp_path):
    for family in FIXTURES:
        root = copy_of(request, family, tmp_path)
        (root / "generation_config.json").unlink()
        load_model(root)


# ------------------------------------------------------------------------------------ codec configs
@pytest.mark.parametrize("family,file", [("v2", "audio_tokenizer/config.json"),
                                         ("qwen3-tts", "speech_tokenizer/config.json")])
def test_codec_config_dtype_must_be_loadable(request, tmp_path, family, file):
    root = copy_of(request, family, tmp_path)
    edit_json(root / file, {"dtype": "int3"})
    load_fails(root, root / file, "dtype " + DTYPE + "'int3'", codec=True)


# ------------------------------------------------------------------------------------ what still loads
def test_unmodified_tiny_checkpoints_load(request):
    for family, fixture in FIXTURES.items():
        root = request.getfixturevalue(fixture)
        talker, cfg, tokenizer = load_model(root)
        assert cfg.max_position_embeddings >= cfg.num_codebooks + 2 and tokenizer is not None
        load_codec_for(root)


def test_config_dtypes_are_the_dtypes_the_loader_reads():
    assert sorted(CONFIG_DTYPES) == sorted(str(t).removeprefix("torch.") for t in _FLOAT_DTYPES.values())


def test_cli_reports_one_line_naming_file_and_field(request, tmp_path, capsys, monkeypatch):
    """The README's promise end to end: `error [checkpoint]` naming the file and the field, exit code 2."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    root = copy_of(request, "v2", tmp_path)
    edit_json(root / "config.json", {"eos_token_id": 99999})
    out = tmp_path / "x.wav"
    assert cli.main(["synth", "--model", str(root), "--text", "Hi.", "--out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error [checkpoint]" in err[0], err
    assert f"{root / 'config.json'}: eos_token_id must be a token id in [0, 768)" in err[0], err
    assert not out.exists()
