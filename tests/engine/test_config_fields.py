"""Strict typed config field readers: an int is an int, a float a real number, a mapping a dict."""

from __future__ import annotations

import pytest
from higgs_stream.engine.config_fields import (
    REQUIRED,
    dict_field,
    float_field,
    int_field,
    int_list_field,
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
