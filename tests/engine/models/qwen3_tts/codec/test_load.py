"""engine/models/qwen3_tts/codec/load.py: where the 12 Hz codec is found for a talker checkpoint."""

from __future__ import annotations

import shutil

import pytest
from higgs_stream.engine.errors import CheckpointError
from higgs_stream.engine.models.qwen3_tts.codec.load import SUBFOLDER, load_qwen_codec


def test_a_talker_checkpoint_without_its_codec_folder_says_so(tmp_path, tiny_qwen_ckpt):
    """It said the talker's config.json had the wrong model_type ('qwen3_tts', expected the tokenizer's): a probe."""
    d = shutil.copytree(tiny_qwen_ckpt, tmp_path / "c")
    shutil.rmtree(d / SUBFOLDER)
    with pytest.raises(CheckpointError, match=f"no {SUBFOLDER}/ folder .* name the tokenizer folder with --codec"):
        load_qwen_codec(d)


def test_the_codec_folder_loads_from_the_checkpoint_or_by_itself(tiny_qwen_ckpt):
    a, b = load_qwen_codec(tiny_qwen_ckpt), load_qwen_codec(tiny_qwen_ckpt / SUBFOLDER)
    assert a.cfg == b.cfg and a.num_codebooks == b.num_codebooks == 16
