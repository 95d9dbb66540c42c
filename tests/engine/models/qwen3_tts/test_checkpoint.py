"""Qwen3-TTS checkpoint loading: bad config fields and absurd layer counts fail fast with a typed error."""

from __future__ import annotations

import json
import shutil

import pytest
from higgs_stream.engine.errors import CheckpointError
from higgs_stream.engine.models.qwen3_tts.checkpoint import load_model
from higgs_stream.engine.models.qwen3_tts.codec.load import SUBFOLDER, load_qwen_codec


@pytest.mark.parametrize("file,edit,match", [
    # absurd layer counts fail on the header check, before a module is built per layer
    ("config.json", lambda c: c["talker_config"].update(num_hidden_layers=10**9),
     r"talker_config.num_hidden_layers is 1000000000, but the weight files hold 2 layers"),
    ("config.json", lambda c: c["talker_config"]["code_predictor_config"].update(num_hidden_layers=10**9),
     r"code_predictor_config.num_hidden_layers is 1000000000, but the weight files hold 2 layers"),
    (f"{SUBFOLDER}/config.json", lambda c: c["decoder_config"].update(num_hidden_layers=10**9),
     r"decoder_config.num_hidden_layers is 1000000000, but the weight files hold 2 layers"),
    # wrongly typed fields: named, never coerced
    ("config.json", lambda c: c["talker_config"].update(hidden_size="16"),
     "talker_config.hidden_size must be an int, got '16'"),
    ("config.json", lambda c: c["talker_config"].update(rms_norm_eps="x"),
     "talker_config.rms_norm_eps must be a number, got 'x'"),
    ("config.json", lambda c: c["talker_config"].update(spk_id=[1, 2]), "talker_config.spk_id must be a JSON object"),
    # looked up in lower case: two that differ only by case were one, the last id winning
    ("config.json", lambda c: c["talker_config"]["spk_id"].update(Ryan=1, ryan=2),
     "talker_config.spk_id has 'Ryan' and 'ryan': names must differ by more than case"),
    ("config.json", lambda c: c.update(im_start_token_id=1.5), "im_start_token_id must be an int, got 1.5"),
    (f"{SUBFOLDER}/config.json", lambda c: c["decoder_config"].update(rope_theta="x"),
     "decoder_config.rope_theta must be a number, got 'x'"),
    (f"{SUBFOLDER}/config.json", lambda c: c.update(output_sample_rate=0), r"output_sample_rate must be an int in \[1, "),
])
def test_bad_checkpoints_fail_fast(tmp_path, tiny_qwen_ckpt, file, edit, match):
    d = shutil.copytree(tiny_qwen_ckpt, tmp_path / "c")
    cfg = json.loads((d / file).read_text())
    edit(cfg)
    (d / file).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match) as e:
        load_model(d)
        load_qwen_codec(d)
    assert e.value.code == "checkpoint" and "config.json" in str(e.value)
