"""The family contract's extensions (engine/family.py), family-agnostic: a prompt's text track fed one
id per decode step, the per-request fields a family refuses when it cannot express them, the
device start row, and the fast path refusing a family that completes rows after the head."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from higgs_stream.engine.batch import StepBatch, StepOutput
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import ConfigError, InvalidInputError
from higgs_stream.engine.family import NO_ID, Prompt
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams


def tiny_prompt(p: int = 3, **extra) -> Prompt:
    return Prompt(input_ids=np.arange(p, dtype=np.int64), audio_codes=np.zeros((p, 2), np.int64),
                  is_audio=np.zeros(p, bool), audio_out=np.zeros((2, 0), np.int64), **extra)


def test_prompt_text_track_then_pad():
    prompt = tiny_prompt(text_track=np.array([7, 8], np.int64), text_pad=5)
    assert [prompt.step_text_id(i) for i in range(4)] == [7, 8, 5, 5]
    assert tiny_prompt().step_text_id(0) == NO_ID  # nothing fed unless the family says so


def test_prompt_optional_tracks_are_checked():
    ok = tiny_prompt(codec_ids=np.array([NO_ID, 4, NO_ID]), vector_rows=np.array([1]), vectors=np.ones((1, 6), np.float32))
    assert ok.vectors.shape == (1, 6)
    with pytest.raises(AssertionError, match="codec_ids"):
        tiny_prompt(codec_ids=np.zeros(2, np.int64))
    with pytest.raises(AssertionError, match="vectors"):
        tiny_prompt(vector_rows=np.array([1]))
    with pytest.raises(AssertionError, match="outside the prompt"):
        tiny_prompt(vector_rows=np.array([3]), vectors=np.ones((1, 6), np.float32))


class Recording(torch.nn.Module):
    """Talker double: records each step's text ids and positions."""

    def __init__(self, talker: torch.nn.Module) -> None:
        super().__init__()
        self.inner = talker
        self.steps: list[tuple[list[int], list[int]]] = []

    def forward(self, batch: StepBatch, cache) -> StepOutput:
        self.steps.append((batch.input_ids.tolist(), batch.positions.tolist()))
        return self.inner.forward(batch, cache)


def test_decode_steps_feed_the_text_track(tiny_v3_ckpt):
    """The reference runner feeds decode step i the prompt's text_track[i], then text_pad."""
    base = Engine.from_pretrained(str(tiny_v3_ckpt), config=EngineConfig(kv_pages=64, max_batch=2))
    rec = Recording(base.talker)
    engine = Engine(rec, base.cfg, base.tokenizer, base.cache, base.config)
    build = engine.policy.build_prompt
    track = [101, 102, 103]
    engine.policy.build_prompt = lambda r: replace(build(r), text_track=np.array(track, np.int64))
    req = GenerationRequest("Hello there.", sampling=SamplingParams(temperature=0.0), max_frames=6)
    frames = engine.generate(req)
    plen = len(build(req))
    decode = [(ids[0], pos[0]) for ids, pos in rec.steps if len(ids) == 1]
    assert [pos for _, pos in decode] == list(range(plen, plen + len(decode)))
    pad = base.tokenizer.special.audio
    assert [i for i, _ in decode] == (track + [pad] * len(decode))[: len(decode)]
    assert frames.shape == (8, 6) and len(decode) >= 6  # v3's 7-row ramp: decode steps outlast the track


def test_higgs_families_refuse_what_they_cannot_express(tiny_ckpt, tiny_v3_ckpt):
    v2 = Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(kv_pages=32, max_batch=2))
    v3 = Engine.from_pretrained(str(tiny_v3_ckpt), config=EngineConfig(kv_pages=32, max_batch=2))
    ref = Reference(np.zeros((8, 3), np.int64), "hi there", embedding=np.ones(4, np.float32))
    for engine in (v2, v3):
        for bad in (dict(speaker="aiden"), dict(language="english"), dict(stream_text=True), dict(reference=ref)):
            with pytest.raises(InvalidInputError, match="takes no"):
                engine.policy.build_prompt(GenerationRequest("Hi.", **bad))
    with pytest.raises(InvalidInputError, match="instructions"):
        v3.policy.build_prompt(GenerationRequest("Hi.", instructions="calm"))
    # v2: instructions are its scene description (OpenAI's `instructions` field)
    a = v2.policy.build_prompt(GenerationRequest("Hi.", instructions="A windy beach."))
    b = v2.policy.build_prompt(GenerationRequest("Hi.", scene="A windy beach."))
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    with pytest.raises(InvalidInputError, match="either instructions or scene"):
        v2.policy.build_prompt(GenerationRequest("Hi.", instructions="x", scene="y"))


def test_request_fields_are_validated():
    with pytest.raises(InvalidInputError, match="speaker must not be empty"):
        GenerationRequest("Hi.", speaker=" ")
    with pytest.raises(InvalidInputError, match="stream_text"):
        GenerationRequest("Hi.", stream_text=1)
    with pytest.raises(InvalidInputError, match="finite 1-D"):
        Reference(np.zeros((8, 2), np.int64), "hi", embedding=np.array([np.nan]))
    assert GenerationRequest("Hi.", instructions="").instructions == ""  # empty: no instructions
    emb = Reference(np.zeros((8, 2), np.int64), "hi", embedding=np.arange(3)).embedding
    assert emb.dtype == np.float32 and not emb.flags.writeable


def test_device_start_row_is_the_family_s(tiny_ckpt):
    """The device state starts a stream from its family's start row (Higgs: all BOS)."""
    engine = Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(kv_pages=64, max_batch=2),
                                    runner=ModelRunnerConfig(kernels="ref", cuda_graphs=False))
    state = engine.runner.state
    assert state.rules.start_row(8, 1024) == (1024,) * 8
    from higgs_stream.engine.gpu_sampling import RowRules, StreamStart

    state.rules = type("Rules", (RowRules,), {"uses_ras": True, "cap": staticmethod(lambda m: m + 1),
                                              "start_row": staticmethod(lambda k, v: tuple(range(k)))})()

    state.start([StreamStart(0, SamplingParams(seed=1, ras_window=2), 5, np.zeros((8, 0), np.int64))])
    assert state.last_col[0].tolist() == list(range(8))
    assert state.window[0, 0].tolist() == list(range(8)) and int(state.win_fill[0]) == 1


def test_the_fast_path_refuses_a_family_that_completes_rows_without_complete_rows(tiny_v3_ckpt):
    base = Engine.from_pretrained(str(tiny_v3_ckpt), config=EngineConfig(kv_pages=64, max_batch=2))
    base.policy.head_codebooks = 1  # as a family whose talker samples one codebook and completes the row
    from higgs_stream.engine.model_runner import ModelRunner

    with pytest.raises(ConfigError, match="has no complete_rows for the fast path"):
        ModelRunner(base.talker, base.cfg, base.cache, base.policy, base.family, 2, 256,
                    ModelRunnerConfig(kernels="ref", cuda_graphs=False))
