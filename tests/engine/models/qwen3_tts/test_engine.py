"""Qwen3-TTS through the engine (plain-torch RefRunner): greedy frames equal the official reference's
(fixtures by scripts/qwen3_reference_fixtures.py, qwen-tts 0.1.1) for every scenario the fixtures
hold, alone and batched with other streams; sampled frames do not depend on what shares the batch;
EOS and the frame cap end a stream (the fast path: test_model_runner.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.models.qwen3_tts.policy import ASSISTANT, REFERENCE
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams

GREEDY = SamplingParams(temperature=0.0)





def make_engine(model, tokenizer, variant: str = "custom_voice", **config) -> Engine:
    cfg = replace(model.cfg, variant=variant)  # the fixture weights under each variant's rules
    cache = KVCache.create(cfg, num_pages=128, page_size=16, dtype=torch.float32)
    return Engine(model, cfg, tokenizer, cache, EngineConfig(**{"kv_pages": 128, "max_batch": 4, **config}))


# the fixture scenarios: (variant, request, frames)
def scenarios(ref) -> dict[str, tuple[str, GenerationRequest, int]]:
    clone = Reference(ref["clone_ref_codes"].T, "R", embedding=ref["clone_spk"])
    return {
        "custom": ("custom_voice", GenerationRequest("A", speaker="aiden", language="english", stream_text=True,
                                                     sampling=GREEDY, max_frames=110), 110),
        "design": ("voice_design", GenerationRequest("B", instructions="I", sampling=GREEDY, max_frames=23), 23),
        "dialect": ("custom_voice", GenerationRequest("B", speaker="dylan", language="chinese", stream_text=True,
                                                      sampling=GREEDY, max_frames=11), 11),
        "clone": ("base", GenerationRequest("A", reference=clone, language="english", sampling=GREEDY,
                                            max_frames=15), 15),
    }


def run_together(engine: Engine, requests: list[GenerationRequest]) -> list[tuple[np.ndarray, str]]:
    """Every request added at once, stepped together: ([F, 16] frames, end reason) each."""
    sids = [engine.add(r) for r in requests]
    frames: dict[int, list] = {s: [] for s in sids}
    reasons: dict[int, str] = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.frame is not None:
                frames[ev.stream_id].append(ev.frame)
            if ev.finished:
                reasons[ev.stream_id] = ev.reason
    return [(np.stack(frames[s]) if frames[s] else np.zeros((0, 16), np.int64), reasons[s]) for s in sids]


@pytest.mark.parametrize("name", ["custom", "design", "dialect", "clone"])
def test_greedy_frames_equal_the_reference_alone(model, tokenizer, ref, name):
    variant, req, n = scenarios(ref)[name]
    (frames, reason), = run_together(make_engine(model, tokenizer, variant), [req])
    np.testing.assert_array_equal(frames, ref[f"{name}_codes"].astype(np.int64), err_msg=name)
    assert frames.shape == (n, 16) and reason == "length"


def test_greedy_frames_equal_the_reference_batched(model, tokenizer, ref):
    """The 110-frame scenario shares every step with two other streams (one joins late, one ends
    early); each stream's frames still equal the reference's."""
    sc = scenarios(ref)
    engine = make_engine(model, tokenizer, "custom_voice")
    sampled = GenerationRequest("B", speaker="aiden", sampling=SamplingParams(temperature=0.9, top_k=50, seed=3),
                                max_frames=40)
    custom = engine.add(sc["custom"][1])
    dialect = engine.add(sc["dialect"][1])
    out: dict[int, list] = {custom: [], dialect: []}
    late = None
    while engine.has_work():
        if late is None and len(out[custom]) == 5:
            late = engine.add(sampled)
            out[late] = []
        for ev in engine.step():
            if ev.frame is not None:
                out[ev.stream_id].append(ev.frame)
    np.testing.assert_array_equal(np.stack(out[custom]), ref["custom_codes"].astype(np.int64))
    np.testing.assert_array_equal(np.stack(out[dialect]), ref["dialect_codes"].astype(np.int64))
    # the sampled stream is the same alone (its codes depend on its logits and its seed only)
    (alone, _), = run_together(make_engine(model, tokenizer, "custom_voice"), [sampled])
    np.testing.assert_array_equal(np.stack(out[late]), alone)


def test_base_from_reference_audio_equals_the_reference(model, tokenizer, ref, tiny_base_dir):
    """A Base request whose reference is audio: our encoders turn it into codes and an x-vector (the
    Base checkpoint's codec), and the greedy frames equal those qwen-tts generates from its own
    encoders' output on the same audio (clone_audio); the same as giving the reference's codes and
    embedding directly."""
    from higgs_stream.engine.models.registry import load_codec_for

    codec = load_codec_for(tiny_base_dir)
    wav = ref["encode_pcm"][0]  # s16 PCM, 0.5 s at 24 kHz
    audio = Reference(codec.encode(wav, 24000), "R", embedding=codec.speaker_embedding(wav, 24000))
    given = Reference(ref["encode_codes_0"].T.astype(np.int64), "R", embedding=ref["speaker_embedding_0"])
    np.testing.assert_array_equal(audio.codes, given.codes)
    req = GenerationRequest("A", reference=audio, language="english", sampling=GREEDY, max_frames=15)
    (frames, reason), (frames_given, _) = run_together(make_engine(model, tokenizer, "base"),
                                                       [req, replace(req, reference=given)])
    np.testing.assert_array_equal(frames, ref["clone_audio_codes"].astype(np.int64))
    np.testing.assert_array_equal(frames_given, frames)
    assert frames.shape == (15, 16) and reason == "length"
    base = make_engine(model, tokenizer, "base")
    with pytest.raises(InvalidInputError, match="transcript"):
        base.add(replace(req, reference=replace(audio, transcript=" ")))


def test_eos_ends_a_stream_without_a_frame(model, tokenizer, ref):
    """With EOS the argmax from frame 2 on (MIN_FRAMES holds it off before), a stream stops there."""
    engine = make_engine(model, tokenizer, "custom_voice")
    eos = model.cfg.codec_eos_id
    engine.policy.process_logits = _boost(engine.policy.process_logits, eos)
    (frames, reason), = run_together(engine, [replace(scenarios(ref)["custom"][1], max_frames=50)])
    assert reason == "stop" and frames.shape == (2, 16)
    np.testing.assert_array_equal(frames, ref["custom_codes"][:2].astype(np.int64))  # the two held-off frames


def _boost(process, eos: int):
    """process_logits, then EOS made the argmax once a stream has its MIN_FRAMES frames."""
    def boosted(logits, segments):
        out = process(logits, segments)
        if all(s.frames >= 2 for s in segments):
            out[..., eos] = 1e6
        return out
    return boosted


def test_sampled_frames_hold_codes_and_respect_the_cap(model, tokenizer):
    engine = make_engine(model, tokenizer, "custom_voice")
    req = GenerationRequest("A", speaker="aiden", sampling=SamplingParams(temperature=1.0, seed=11), max_frames=7)
    (frames, reason), = run_together(engine, [req])
    assert frames.shape[1] == 16 and 1 <= frames.shape[0] <= 7
    assert (frames >= 0).all() and (frames < model.cfg.codebook_size).all()
    assert reason == ("length" if frames.shape[0] == 7 else "stop")
    assert engine.cache.allocator.num_used == 0  # the stream's pages are freed


def test_bad_requests_are_typed(model, tokenizer, ref):
    custom = make_engine(model, tokenizer, "custom_voice")
    with pytest.raises(InvalidInputError, match="unknown speaker 'nobody'"):
        custom.add(GenerationRequest("A", speaker="nobody"))
    with pytest.raises(InvalidInputError, match="takes no instructions"):
        custom.add(GenerationRequest("A", instructions="I"))  # a 0.6B CustomVoice checkpoint
    with pytest.raises(InvalidInputError, match="no scene"):
        custom.add(GenerationRequest("A", scene="a hall"))
    with pytest.raises(InvalidInputError, match="takes no reference"):
        custom.add(GenerationRequest("A", reference=Reference(np.zeros((16, 2), np.int64), "R")))
    base = make_engine(model, tokenizer, "base")
    with pytest.raises(InvalidInputError, match="Base checkpoint clones a voice"):
        base.add(GenerationRequest("A"))
    with pytest.raises(InvalidInputError, match="speaker embedding"):
        base.add(GenerationRequest("A", reference=Reference(np.zeros((16, 2), np.int64), "R")))
    with pytest.raises(InvalidInputError, match="no built-in speakers"):
        make_engine(model, tokenizer, "voice_design").policy.build_prompt(GenerationRequest("A", speaker="aiden"))
    injected = type(tokenizer)({ASSISTANT.format("A"): [153, 11, 13, 40, 153, 41, 154, 13, 153, 11, 13]})
    with pytest.raises(InvalidInputError, match="control tokens"):
        make_engine(model, injected).add(GenerationRequest("A"))


def test_check_transcript_is_the_reference_transcript_check(model, tokenizer, ref):
    """A Base reference's transcript "R" passes; with a control id in its part of the template, `check_transcript`
    refuses it as the prompt does, with the same message."""
    base = make_engine(model, tokenizer, "base")
    base.check_transcript("R")
    ids = ref["clone_ref_ids"].tolist()
    injected = type(tokenizer)({**tokenizer.table, REFERENCE.format("R"): ids[:4] + [model.cfg.tts_bos_id] + ids[4:]})
    base = make_engine(model, injected, "base")
    with pytest.raises(InvalidInputError, match="^reference transcript contains control tokens") as alone:
        base.check_transcript("R")
    reference = Reference(np.zeros((16, 2), np.int64), "R", embedding=np.zeros(model.cfg.hidden_size, np.float32))
    with pytest.raises(InvalidInputError) as in_request:
        base.check(GenerationRequest("A", reference=reference))
    assert str(alone.value) == str(in_request.value)


def test_custom_voice_defaults_to_the_first_speaker_and_text_in_the_prompt(model, tokenizer):
    engine = make_engine(model, tokenizer, "custom_voice")
    plain = engine.policy.qwen_prompt(GenerationRequest("A"))
    named = engine.policy.qwen_prompt(GenerationRequest("A", speaker="aiden"))
    assert engine.policy.default_speaker == "aiden"
    np.testing.assert_array_equal(plain.codec_ids, named.codec_ids)
    assert model.cfg.speakers["aiden"] in plain.codec_ids.tolist()
    assert plain.trailing.size == 0  # CustomVoice: all text in the prompt by default (the reference's)
