"""Strict typed config field readers: an int is an int, a float a real number, a mapping a dict."""

from __future__ import annotations

import pytest
from higgs_stream.engine.config_fields import (
    REQUIRED,
    bool_field,
    dict_field,
    dtype_fields,
    float_field,
    hf_token_ids,
    int_field,
    int_list_field,
    token_id_field,
)
from higgs_stream.engine.errors import ConfigError


@pytest.mark.parametrize("value,match", [
    ("64", "must be an int, got '64'"), (64.5, "must be an int, got 64.5"), (64.0, "must be an int"),
    (True, "must be an int, got True"), ([1], r"must be an int, got \[1\]"), (0, r"must be an int in \[1, "),
    (-3, r"must be an int in \[1, "), (2**40, r"must be an int in \[1, 2147483647\], got 1099511627776"),
])
def test_int_field_rejects(value, match):
    with pytest.raises(ConfigError, match=r"text_config\.hidden_size " + match):
        int_field({"hidden_size": value}, "hidden_size", "text_config.")


@pytest.mark.parametrize("reader,value,match", [
    (float_field, "x", "must be a number, got 'x'"), (float_field, True, "must be a number"),
    (float_field, float("nan"), "must be a number"), (float_field, -1.0, "must be > 0"), (float_field, 0, "must be > 0"),
    (dict_field, "x", "must be a JSON object, got 'x'"), (dict_field, [1, 2], "must be a JSON object"),
    (int_list_field, "x", "must be a non-empty list of ints"), (int_list_field, [], "must be a non-empty list of ints"),
    (int_list_field, [8, -1], "must be a non-empty list of ints"), (int_list_field, [8, True], "must be a non-empty list of ints"),
])
def test_other_readers_reject(reader, value, match):
    with pytest.raises(ConfigError, match="f " + match):
        reader({"f": value}, "f")


def test_accepted_values_defaults_and_required():
    assert int_field({"n": 2}, "n") == 2 and int_field({"n": -100}, "n", lo=None) == -100
    assert float_field({"eps": 1}, "eps") == 1.0 and isinstance(float_field({"eps": 1}, "eps"), float)
    assert int_field({}, "n", default=8) == 8 and int_field({"n": None}, "n", default=8) == 8  # null: absent
    assert dict_field({"d": {"a": 1}}, "d") == {"a": 1} and int_list_field({"r": [8, 5]}, "r") == (8, 5)
    with pytest.raises(ConfigError, match=r"text_config\.vocab_size is required"):
        int_field({"vocab_size": None}, "vocab_size", "text_config.", REQUIRED)


@pytest.mark.parametrize("value,many,match", [
    (768, False, r"must be a token id in \[0, 768\) \(text_config.vocab_size is 768\), got 768"),
    (-1, False, r"must be a token id in \[0, 768\)"), ("5", False, "must be an int, got '5'"),
    (True, False, "must be an int, got True"), ([5], False, r"must be an int, got \[5\]"),
    ([5, 768], True, r"must be a token id in \[0, 768\) .*got \[5, 768\]"),
    ([], True, r"must be an int or a non-empty list of ints, got \[\]"),
    ([5, 6.0], True, "must be an int or a non-empty list of ints"),
])
def test_token_id_field_rejects(value, many, match):
    with pytest.raises(ConfigError, match=r"text_config\.eos_token_id " + match):
        token_id_field({"eos_token_id": value}, "eos_token_id", "text_config.", vocab=768,
                       table="text_config.vocab_size", many=many)


def test_token_ids_accepted_and_absent():
    assert token_id_field({"i": 0}, "i", vocab=2) == 0 and token_id_field({"i": 1}, "i", vocab=2) == 1
    assert token_id_field({"i": [0, 1]}, "i", vocab=2, many=True) == (0, 1)
    assert token_id_field({}, "i", vocab=2) is None and token_id_field({"i": None}, "i", vocab=2, default=7) == 7
    with pytest.raises(ConfigError, match="i is required"):
        token_id_field({}, "i", default=REQUIRED, vocab=2)
    hf_token_ids({"bos_token_id": 1, "eos_token_id": [0, 1], "pad_token_id": None}, "", 2)  # all in range
    with pytest.raises(ConfigError, match=r"pad_token_id must be a token id in \[0, 2\)"):
        hf_token_ids({"bos_token_id": 1, "pad_token_id": 2}, "", 2)
    with pytest.raises(ConfigError, match=r"bos_token_id must be an int, got \[1\]"):  # only eos may be a list
        hf_token_ids({"bos_token_id": [1]}, "", 2)


def test_flags_dtypes_bounded_floats_and_reasons():
    assert bool_field({"b": False}, "b") is False and bool_field({}, "b", default=True) is True
    for bad in (1, 0, "true"):
        with pytest.raises(ConfigError, match=f"b must be true or false, got {bad!r}"):
            bool_field({"b": bad}, "b")
    dtype_fields({"dtype": "bfloat16", "torch_dtype": "float32"})
    dtype_fields({"torch_dtype": None})  # null: absent
    for key in ("dtype", "torch_dtype"):
        with pytest.raises(ConfigError, match=f"x.{key} must be one of float32, float16, bfloat16, got 'int3'"):
            dtype_fields({key: "int3"}, "x.")
    assert float_field({"p": 1}, "p", hi=1.0) == 1.0
    for bad in (0, 1.01):
        with pytest.raises(ConfigError, match=rf"p must be a number in \(0, 1.0\], got {bad}"):
            float_field({"p": bad}, "p", hi=1.0)
    with pytest.raises(ConfigError, match=r"n must be an int in \[10, 2147483647\] \(room for a frame\), got 9"):
        int_field({"n": 9}, "n", lo=10, why="room for a frame")
