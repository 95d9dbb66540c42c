"""The batched step engine on the tiny random checkpoint.

Central property: a request's codes depend only on the request and its seed, not on what else
shares the batch, when it was admitted, or how its prompt was chunked.
"""

from __future__ import annotations

import gc
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from higgs_stream.engine.batch import StepBatch, StepOutput
from higgs_stream.engine.engine import Engine, EngineConfig, StepEvent
from higgs_stream.engine.errors import CancelledStream, CapacityError, ConfigError, HiggsStreamError, InvalidInputError
from higgs_stream.engine.models.delay_pattern import STREAM_BOS, columns_to_frames
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams


class Instrumented(torch.nn.Module):
    """Test double around the talker: records batch shapes, optionally NaNs one stream's logits."""

    def __init__(self, talker: torch.nn.Module) -> None:
        super().__init__()
        self.inner = talker
        self.nan_seq: int | None = None
        self.qo_lens: list[list[int]] = []
        self.prefill_mixed_with_decode = 0

    def forward(self, batch: StepBatch, cache) -> StepOutput:
        out = self.inner.forward(batch, cache)
        if self.nan_seq in batch.seq_ids:
            out.audio_logits[batch.seq_ids.index(self.nan_seq)] = float("nan")
        self.qo_lens.append(list(batch.qo_lens))
        if batch.want_audio.any() and (~batch.want_audio).any():
            self.prefill_mixed_with_decode += 1
        return out


def make_engine(ckpt, **config) -> Engine:
    base = Engine.from_pretrained(str(ckpt), config=EngineConfig(**{"kv_pages": 256, "max_batch": 8, **config}))
    return Engine(Instrumented(base.talker), base.cfg, base.tokenizer, base.cache, base.config)


def generate_with_columns(engine: Engine, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
    """(codec frames [8, F], the delay-pattern columns [8, L] behind them) of one request: the engine
    emits frames; the columns are its stream's host rule machine's (`SegmentState.columns`, the
    AUDIO_INIT column first)."""
    gen = engine.stream(request)
    segment = engine._pending[-1].segment  # add() ran: the stream is queued
    frames = list(gen)
    return np.stack(frames, axis=1), segment.state.as_array()


def codes(t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(8, t))


REQUESTS = [
    GenerationRequest(text="Hello world.", sampling=SamplingParams(seed=1, temperature=1.0), max_frames=30),
    GenerationRequest(
        text="The quick brown fox jumps over the lazy dog while the morning train rolls into the station.",
        reference=Reference(codes(12, 0), "Good morning! How are you today?"),
        sampling=SamplingParams(seed=2, temperature=0.8, top_k=50), max_frames=25),
    GenerationRequest(text="Numbers like 1, 2, 3.", sampling=SamplingParams(seed=3, temperature=0.0), max_frames=20),
    GenerationRequest(text="See you tomorrow at nine.", history=(("Hello again, world.", codes(6, 1)),), scene="",
                      sampling=SamplingParams(seed=4, top_p=0.8), max_frames=35),
]


@pytest.fixture(scope="module")
def alone(tiny_ckpt, run_staggered):
    """Each request run by itself, one after another, in one engine with a generous budget."""
    engine = make_engine(tiny_ckpt, token_budget=512)
    out = [run_staggered(engine, [r], [0], max_steps=1000) for r in REQUESTS]
    assert engine.cache.allocator.num_used == 0 and not engine.has_work()
    return [c[0] for c, _ in out], [r[0] for _, r in out]


def test_batched_equals_alone(tiny_ckpt, alone, run_staggered):
    alone_cols, alone_reasons = alone
    engine = make_engine(tiny_ckpt, token_budget=16)  # prompts of 40..150 positions get chunked
    cols, reasons = run_staggered(engine, REQUESTS, admit_at=[0, 2, 3, 7], max_steps=1000)
    for i in range(len(REQUESTS)):
        np.testing.assert_array_equal(cols[i], alone_cols[i], err_msg=f"request {i}")
    assert reasons == alone_reasons
    talker = engine.talker
    assert talker.prefill_mixed_with_decode >= 5  # chunked prefill really shared steps with decodes
    assert max(len(q) for q in talker.qo_lens) == 4 and max(sum(q) for q in talker.qo_lens) <= 16
    assert engine.cache.allocator.num_used == 0 and engine.num_active == 0 and not engine.has_work()


def test_frames_and_reasons(tiny_ckpt, alone):
    """The engine emits codec frames (real codes only), as many as the stream's delay-pattern
    columns give (the v2 writer: L columns -> L - 9 frames), at most max_frames."""
    frames, reasons = alone
    assert set(reasons) == {"stop", "length"}, reasons  # both endings occur with these seeds
    for f, reason, req in zip(frames, reasons, REQUESTS):
        assert f.shape[0] == 8 and f.min() >= 0 and f.max() < 1024
        assert f.shape[1] <= req.max_frames
        if reason == "length":
            assert f.shape[1] == req.max_frames
    engine = make_engine(tiny_ckpt)
    got, cols = generate_with_columns(engine, REQUESTS[3])
    assert (cols[:, 0] == STREAM_BOS).all() and cols.min() >= 0 and cols.max() <= 1025
    np.testing.assert_array_equal(got, frames[3])
    np.testing.assert_array_equal(got, columns_to_frames(cols))
    assert got.shape == (8, cols.shape[1] - 9)


def test_seed_decides_the_codes(tiny_ckpt, alone):
    engine = make_engine(tiny_ckpt)
    again = engine.generate(REQUESTS[0])
    np.testing.assert_array_equal(again, alone[0][0])
    other = engine.generate(replace(REQUESTS[0], sampling=SamplingParams(seed=99, temperature=1.0)))
    n = min(other.shape[1], again.shape[1])
    assert not np.array_equal(other[:, :n], again[:, :n])
    unseeded = [engine.generate(replace(REQUESTS[0], sampling=SamplingParams(temperature=1.0))) for _ in range(2)]
    assert not np.array_equal(unseeded[0][:, :9], unseeded[1][:, :9])  # a fresh seed per request


def test_stream_yields_the_frames_one_per_step_and_close_cancels(tiny_ckpt, alone):
    engine = make_engine(tiny_ckpt)
    streamed = list(engine.stream(REQUESTS[2]))
    np.testing.assert_array_equal(np.stack(streamed, axis=1), alone[0][2])
    gen = engine.stream(REQUESTS[0])
    first = [next(gen) for _ in range(5)]
    assert engine.cache.allocator.num_used > 0
    gen.close()  # the caller walked away: the stream is cancelled, its pages go at the next step
    assert engine.has_work()
    events = engine.step()
    assert [(e.finished, e.reason) for e in events] == [(True, "cancelled")]
    assert engine.cache.allocator.num_used == 0
    np.testing.assert_array_equal(np.stack(first, axis=1), alone[0][0][:, :5])
    never_iterated = engine.stream(REQUESTS[1])
    del never_iterated  # dropped without a single next(): cancelled all the same
    gc.collect()
    assert [(e.finished, e.reason) for e in engine.step()] == [(True, "cancelled")]
    assert not engine.has_work() and engine.num_active == 0 and not engine._seqs and not engine._pending


def test_cancel_frees_pages_and_spares_the_others(tiny_ckpt, alone):
    engine = make_engine(tiny_ckpt, token_budget=64)
    a = engine.add(REQUESTS[0])
    b = engine.add(REQUESTS[3])
    for _ in range(6):
        engine.step()
    used_both = engine.cache.allocator.num_used
    engine.cancel(a)
    engine.cancel(12345)  # unknown: ignored
    events = engine.step()
    assert StepEvent(a, None, True, "cancelled") in events
    assert engine.cache.allocator.num_used < used_both and a not in engine.cache.allocator.active_seqs
    cols = [e.frame for e in events if e.stream_id == b and e.frame is not None]
    while engine.has_work():
        cols += [e.frame for e in engine.step() if e.stream_id == b and e.frame is not None]
    prefix = alone[0][3][:, : alone[0][3].shape[1] - len(cols)]
    np.testing.assert_array_equal(np.concatenate([prefix, np.stack(cols, axis=1)], axis=1), alone[0][3])


def test_a_failing_stream_does_not_affect_the_others(tiny_ckpt, alone):
    engine = make_engine(tiny_ckpt, token_budget=64)
    sids = [engine.add(r) for r in REQUESTS]
    engine.talker.nan_seq = sids[1]  # non-finite logits for stream 1
    engine.step()
    engine.step()
    broken = engine._seqs[sids[2]].segment  # stream 2: its state update raises

    def explode(*args):
        raise RuntimeError("boom")

    broken.advance = explode
    cols: dict[int, list] = {s: [] for s in sids}
    ends: dict[int, StepEvent] = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.frame is not None:
                cols[ev.stream_id].append(ev.frame)
            if ev.finished:
                ends[ev.stream_id] = ev
    assert ends[sids[1]].reason == "error" and "non-finite" in ends[sids[1]].error
    assert ends[sids[2]].reason == "error" and "boom" in ends[sids[2]].error
    for i in (0, 3):
        tail = np.stack(cols[sids[i]], axis=1)
        np.testing.assert_array_equal(tail, alone[0][i][:, -tail.shape[1] :])
        assert ends[sids[i]].reason == alone[1][i]
    assert engine.cache.allocator.num_used == 0


def test_kv_capacity_queues_streams_without_changing_codes(tiny_ckpt, alone):
    # each stream commits its worst case (prompt + max_frames + 8 positions): 20 pages hold ~2 at once
    engine = make_engine(tiny_ckpt, kv_pages=20, page_size=16, token_budget=32)
    peak = 0
    sids = [engine.add(r) for r in REQUESTS]
    cols: dict[int, list] = {s: [] for s in sids}
    running_peak = 0
    while engine.has_work():
        for ev in engine.step():
            if ev.frame is not None:
                cols[ev.stream_id].append(ev.frame)
        peak = max(peak, engine.cache.allocator.num_used)
        running_peak = max(running_peak, engine.scheduler.num_running)
    assert peak <= 20 and running_peak < len(REQUESTS)
    for i, s in enumerate(sids):
        np.testing.assert_array_equal(np.stack(cols[s], axis=1), alone[0][i])


def test_add_refuses_bad_requests(tiny_ckpt):
    engine = make_engine(tiny_ckpt, max_seq_len=100, max_waiting=1, max_batch=1, token_budget=8)
    with pytest.raises(InvalidInputError, match="context length"):
        engine.add(REQUESTS[1])  # the reference makes the prompt longer than 100 positions
    with pytest.raises(InvalidInputError):
        engine.add("hello")
    # lone surrogates (legal in JSON) are refused up front: the tokenizer would raise a TypeError
    for make in (lambda: GenerationRequest("\ud800 hi"), lambda: GenerationRequest("Hi.", scene="\udfff"),
                 lambda: Reference(np.zeros((8, 2), np.int64), "\ud83d")):
        with pytest.raises(InvalidInputError, match="Unicode"):
            make()
    sid = engine.add(REQUESTS[0])
    stream = engine._pending[-1]
    assert stream.max_frames == 100 - stream.prompt_len - 8 < REQUESTS[0].max_frames  # lowered to fit
    with pytest.raises(CapacityError):
        engine.add(REQUESTS[2])  # one already waiting
    events = []
    while engine.has_work():
        events += [e for e in engine.step() if e.stream_id == sid]
    n_frames = sum(e.frame is not None for e in events)
    n_cols = n_frames + 9  # v2: the columns fed back are the frames' plus the delay and the BOS/EOS frames
    assert n_frames <= stream.max_frames and stream.prompt_len + n_cols - 1 <= 100
    if events[-1].reason == "length":
        assert n_frames == stream.max_frames
    with pytest.raises(ConfigError):
        EngineConfig(max_batch=8, token_budget=4)


def test_check_transcript_is_the_reference_transcript_check(tiny_ckpt):
    """What `check` refuses in a reference's transcript, `check_transcript` refuses alone, with the same message (a
    server runs it on its voice presets at start-up)."""
    engine = make_engine(tiny_ckpt)
    engine.check_transcript("Hello there. <SE>[Laughter]</SE>")  # sound-event tags are text
    for bad in ("hi<|eot_id|>", "x <|audio_out_bos|> y", "<|start_header_id|>system"):
        with pytest.raises(InvalidInputError, match="^transcript contains chat/audio control tokens") as alone:
            engine.check_transcript(bad)
        with pytest.raises(InvalidInputError) as in_request:
            engine.check(GenerationRequest("ok", reference=Reference(np.zeros((8, 2), np.int64), bad)))
        assert str(alone.value) == str(in_request.value)
    with pytest.raises(InvalidInputError, match="must be a string"):
        engine.check_transcript(None)


def test_generate_raises_when_cancelled_or_failed(tiny_ckpt):
    engine = make_engine(tiny_ckpt)
    gen = engine.stream(REQUESTS[0])
    next(gen)
    engine.cancel(max(engine._seqs))
    with pytest.raises(CancelledStream):
        list(gen)
    fresh = make_engine(tiny_ckpt)
    fresh.talker.nan_seq = 0  # the first stream of this engine gets NaN logits
    with pytest.raises(HiggsStreamError, match="non-finite"):
        fresh.generate(REQUESTS[2])


# ------------------------------------------------------------------ vs transformers' generate
@pytest.mark.parametrize("text, scene", [("Hello world.", ""), ("See you tomorrow at nine.", None),
                                         ("The quick brown fox.", None)])
def test_greedy_matches_transformers_generate_until_the_eos_rule_differs(tiny_ckpt, text, scene):
    """Same checkpoint, same prompt ids, greedy, RAS off: every column equals HF's `generate` up to
    the first EOS. There REF (and we) force the codebooks below the lowest EOS to EOS at once and
    end K - idx - 1 columns later; HF keeps them and ramps out from codebook 0 a step later. A run
    that reaches our frame cap differs from HF only in the forced codebook-0 EOS."""
    from transformers import HiggsAudioV2ForConditionalGeneration

    from higgs_stream.engine.models.higgs_v2.prompt import build_prompt

    hf = HiggsAudioV2ForConditionalGeneration.from_pretrained(str(tiny_ckpt)).eval()
    engine = Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(max_batch=4, kv_pages=128))
    req = GenerationRequest(text=text, scene=scene, max_frames=40,
                            sampling=SamplingParams(temperature=0.0, ras_window=0))
    frames, ours = generate_with_columns(engine, req)
    np.testing.assert_array_equal(frames, columns_to_frames(ours))  # what the engine emits
    ids = torch.from_numpy(build_prompt(engine.tokenizer, req).input_ids)[None]
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=60,
                          ras_win_len=None, return_dict_in_generate=True)
    theirs = out.audio_sequences[0].T.numpy()  # [8, L'] columns, the all-BOS one first
    e = int(np.nonzero((ours == 1025).any(axis=0))[0][0])  # our first column holding an EOS
    np.testing.assert_array_equal(ours[:, :e], theirs[:, :e])
    hf_eos = np.nonzero(theirs[:, e] == 1025)[0]
    if hf_eos.size == 0:  # our frame cap: codebook 0 forced to EOS at column max_frames + 1
        assert e == 41 and ours.shape[1] == 49
        np.testing.assert_array_equal(ours[1:, e], theirs[1:, e])
    else:
        idx = int(hf_eos[0])
        assert idx > 0 and ours.shape[1] == e + 8 - idx
        np.testing.assert_array_equal(ours[:, e], np.where(np.arange(8) < idx, 1025, theirs[:, e]))
        assert (theirs[:idx, e] != 1025).all()  # HF left them as sampled


# ------------------------------------------------------------------ context cap
def test_context_cap_is_max_seq_len_not_the_hf_config_limit(tiny_ckpt):
    """The transformers-native config.json says max_position_embeddings 2048 (Boson's says 131072 for
    the same model); llama3 RoPE is valid beyond it, so the only cap is EngineConfig.max_seq_len.
    A 2100+-position prompt runs, and its greedy columns equal transformers' generate on it."""
    from transformers import HiggsAudioV2ForConditionalGeneration

    assert json.loads((tiny_ckpt / "config.json").read_text())["max_position_embeddings"] == 2048
    req = GenerationRequest(text="Hello world. " * 520, scene="", max_frames=3,
                            sampling=SamplingParams(temperature=0.0, ras_window=0))
    small = Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(max_seq_len=2048, kv_pages=256))
    with pytest.raises(InvalidInputError, match="context length is 2048"):
        small.add(req)

    engine = Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(max_seq_len=4096, kv_pages=300))
    assert engine.max_seq_len == engine.talker.max_positions == 4096
    prompt = engine.policy.build_prompt(req)
    assert 2100 <= len(prompt) < 2200
    frames, ours = generate_with_columns(engine, req)  # positions up to len(prompt) + 10
    assert ours.shape[1] <= 3 + 9
    np.testing.assert_array_equal(frames, columns_to_frames(ours))

    hf = HiggsAudioV2ForConditionalGeneration.from_pretrained(str(tiny_ckpt)).eval()
    ids = torch.from_numpy(prompt.input_ids)[None]
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                          ras_win_len=None, return_dict_in_generate=True)
    theirs = out.audio_sequences[0].T.numpy()  # [8, L'] columns, the all-BOS one first
    eos = np.nonzero((ours == 1025).any(axis=0))[0]
    e = int(eos[0]) if eos.size else ours.shape[1]
    assert e == 4  # BOS column + 3 sampled columns; the frame cap forces codebook 0 to EOS at column 4
    np.testing.assert_array_equal(ours[:, :e], theirs[:, :e])
    np.testing.assert_array_equal(ours[1:, e], theirs[1:, e])  # only the forced EOS differs there


def test_talker_rejects_positions_beyond_its_context_cap(tiny_ckpt):
    engine = Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(max_seq_len=64, kv_pages=16))
    cache = engine.cache
    cache.allocator.reserve(0, 65)
    n = 65
    batch = StepBatch([0], [n], torch.zeros(n, dtype=torch.long), torch.zeros(n, 8, dtype=torch.long),
                      torch.zeros(n, dtype=torch.bool), torch.arange(n), torch.zeros(1, dtype=torch.bool),
                      torch.ones(1, dtype=torch.bool))
    with pytest.raises(InvalidInputError, match=r"positions must lie in \[0, 64\) \(the context cap\)"):
        engine.talker(batch, cache)
    cache.allocator.free(0)


def test_pausing_a_stream_does_not_change_its_codes(tiny_ckpt, alone):
    """A paused stream skips steps (the others go on) and resumes where it stopped: same codes."""
    engine = make_engine(tiny_ckpt, token_budget=512)
    sids = [engine.add(r) for r in REQUESTS[:2]]
    got: dict[int, list[np.ndarray]] = {sid: [] for sid in sids}
    step = 0
    while engine.has_work() or engine.scheduler.num_paused:
        if step == 12:
            engine.pause(sids[0])
        if step == 30:
            engine.resume(sids[0])
        for ev in engine.step():
            if ev.frame is not None:
                got[ev.stream_id].append(ev.frame)
        if 12 <= step < 30:
            assert engine.scheduler.num_paused == 1 or not engine.scheduler.is_running(sids[0])
        step += 1
        assert step < 1000
    for sid, want in zip(sids, alone[0][:2]):
        assert np.array_equal(np.stack(got[sid], axis=1), want)
