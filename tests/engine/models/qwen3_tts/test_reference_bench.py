"""scripts/qwen3_reference_bench.py runs in the reference's environment (qwen-tts 0.1.1, transformers 4.57.3),
never in this suite; here only its facts are checked against ours: the released shapes it builds are our
presets', its sampling the released generation_config.json's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from higgs_stream.engine.models.qwen3_tts.config import preset

SCRIPT = Path(__file__).resolve().parents[4] / "scripts/qwen3_reference_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("qwen3_reference_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # top level: stdlib and torch only (qwen_tts is imported inside main)
    return mod


@pytest.mark.parametrize("size", ["0.6b", "1.7b"])
def test_released_shapes_match_our_presets(bench, size):
    config, generation = preset(size).to_json()
    assert bench.released_talker(size) == config["talker_config"]
    assert bench.SIZES[size] == config["tts_model_size"]
    assert {k: config[k] for k in bench.RELEASED_TEXT_IDS} == bench.RELEASED_TEXT_IDS
    assert bench.SAMPLING == {k: v for k, v in generation.items() if k != "max_new_tokens"}
    assert bench.SPEAKER in config["talker_config"]["spk_id"]
    assert config["talker_config"]["spk_is_dialect"][bench.SPEAKER] is False


def test_stand_in_module_raises_on_use(bench):
    mod = bench._stand_in("librosa")
    assert mod.__spec__.name == "librosa"
    with pytest.raises(RuntimeError, match="stand-in"):
        mod.load("x.wav")
    with pytest.raises(AttributeError):
        mod.__wrapped__  # dunder probes (inspect, pickle) see no attribute
