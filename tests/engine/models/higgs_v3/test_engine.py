"""End to end on a tiny random v3 checkpoint: load -> engine -> rows -> codec frames -> codec -> waveform.

The oracle for the engine wiring is a plain loop written here over the same TalkerV3: one
prefill of the whole prompt whose last position (the final `<|audio|>`) gives row 0, then one
`<|audio|>` step per row carrying the previous row, greedy argmax per codebook, RowState for
the ramp/EOC rules. The engine (chunked prefill, paged KV, batched sampling) must produce the
same rows (read from each stream's host rule machine; the engine itself emits the codec frames
the family's writer makes of them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from higgs_stream.engine.batch import StepBatch
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.models.delay_pattern import DelayWriter
from higgs_stream.engine.models.higgs_v3.checkpoint import load_codec_v3
from higgs_stream.engine.models.higgs_v3.policy import RowState
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
from higgs_stream.engine.synth import synthesize
from higgs_stream.stream.adapter import Code2WavAdapter

K = 8


@pytest.fixture(scope="module")
def ckpt(tiny_v3_ckpt) -> Path:
    return tiny_v3_ckpt  # make_checkpoint_v3(DIR, preset="tiny", seed=0), session-wide


@pytest.fixture(scope="module")
def engine(ckpt) -> Engine:
    # a small token budget so the prompt is prefilled in several chunks
    return Engine.from_pretrained(str(ckpt), config=EngineConfig(max_batch=4, token_budget=8, kv_pages=64,
                                                                    page_size=4))


@pytest.fixture(scope="module")
def codec(ckpt):
    return load_codec_v3(ckpt)


def oracle_rows(engine: Engine, request: GenerationRequest) -> list[tuple[int, ...]]:
    talker, cfg = engine.talker, engine.cfg
    prompt = engine.policy.build_prompt(request)
    cache = KVCache.create(cfg, num_pages=64, page_size=16)
    state = RowState(K, 1024, max_frames=request.max_frames)

    def run(ids, codes, is_audio, start) -> torch.Tensor:
        n = len(ids)
        cache.allocator.reserve(0, start + n)
        batch = StepBatch([0], [n], torch.as_tensor(ids), torch.as_tensor(codes), torch.as_tensor(is_audio),
                          torch.arange(start, start + n), torch.zeros(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool))
        return talker(batch, cache).audio_logits[0]  # [8, 1026]

    logits = run(prompt.input_ids, prompt.audio_codes, prompt.is_audio, 0)
    pos = len(prompt)
    while True:
        state.advance(logits.argmax(-1).tolist())
        if state.finished:
            return state.rows
        logits = run(np.array([cfg.special.audio]), np.array([state.last_row]), np.array([True]), pos)
        pos += 1


def generate_with_rows(engine: Engine, request: GenerationRequest) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """(codec frames [8, F] the engine emits, the rows behind them: its stream's `RowState.rows`)."""
    gen = engine.stream(request)
    segment = engine._pending[-1].segment  # add() ran: the stream is queued
    frames = list(gen)
    return (np.stack(frames, axis=1) if frames else np.zeros((K, 0), np.int64)), segment.state.rows


def rows_to_frames(rows: list[tuple[int, ...]]) -> np.ndarray:
    """The v3 writer offline: R rows -> R - 7 frames."""
    writer = DelayWriter(K, 1024, wrapped=False)
    frames = [f for f in (writer.push(r) for r in rows) if f is not None]
    return np.array(frames, np.int64).T.reshape(K, len(frames))


def greedy(text: str, **kw) -> GenerationRequest:
    return GenerationRequest(text=text, sampling=SamplingParams(temperature=0.0, seed=0), **kw)


def test_greedy_zero_shot_matches_the_oracle_and_decodes(engine, codec):
    req = greedy("Hello there, this is a test.", max_frames=6)
    rows = oracle_rows(engine, req)
    assert len(rows) == 6 + 7
    frames, engine_rows = generate_with_rows(engine, req)
    assert engine_rows == rows
    assert frames.shape == (K, len(rows) - 7) and np.array_equal(frames, rows_to_frames(rows))
    wav, codes = synthesize(engine, codec, req)
    assert np.array_equal(codes, frames)
    assert wav.shape == (6 * 960,) and wav.dtype == np.float32 and np.isfinite(wav).all()
    assert np.array_equal(wav, codec.decode(torch.from_numpy(frames)[None])[0].numpy())


def test_voice_clone_through_the_bundled_codec(engine, codec):
    t = np.arange(int(0.6 * 24000)) / 24000
    ref_wav = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    ref_codes = codec.encode(ref_wav, 24000)  # [8, T]
    assert ref_codes.shape[0] == K and ref_codes.max() < 1024
    req = greedy("Now in that voice.", reference=Reference(codes=ref_codes, transcript="A sine tone."), max_frames=4)
    prompt = engine.policy.build_prompt(req)
    assert int(prompt.is_audio.sum()) == ref_codes.shape[1] + 7
    frames, rows = generate_with_rows(engine, req)
    assert oracle_rows(engine, req) == rows and np.array_equal(frames, rows_to_frames(rows))


def test_streams_batched_together_equal_each_alone_and_stream_equals_generate(engine, codec):
    reqs = [GenerationRequest(text=f"Stream number {i} speaks.", max_frames=5 + 3 * i,
                              sampling=SamplingParams(temperature=0.9, top_k=50, seed=10 + i)) for i in range(3)]
    alone = [engine.generate(r) for r in reqs]
    sids = [engine.add(r) for r in reqs]
    got: dict[int, list[np.ndarray]] = {sid: [] for sid in sids}
    finished = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.frame is not None:
                got[ev.stream_id].append(ev.frame)
            if ev.finished:
                finished[ev.stream_id] = ev.reason
    for sid, cols in zip(sids, alone):
        assert np.array_equal(np.stack(got[sid], axis=1), cols)
        assert finished[sid] == "length"
    assert np.array_equal(np.stack(list(engine.stream(reqs[0])), axis=1), alone[0])
    assert engine.cache.allocator.num_used == 0  # every stream's pages were freed

    # the streaming adapter takes v3 frames like any other and reproduces the one-shot decode
    adapter = Code2WavAdapter(codec)
    last = alone[2].shape[1] - 1
    chunks = [c for i, frame in enumerate(alone[2].T) for c in adapter.push(frame, final=i == last)]
    assert adapter.finish() == []
    one_shot = codec.decode(torch.from_numpy(alone[2])[None])[0].numpy()
    assert np.allclose(np.concatenate(chunks), one_shot, atol=1e-5)


def test_non_finite_logits_fail_only_that_stream(ckpt, monkeypatch):
    engine = Engine.from_pretrained(str(ckpt), config=EngineConfig(max_batch=4, token_budget=64, kv_pages=64,
                                                                      page_size=4))
    good, bad = (engine.add(greedy(t, max_frames=3)) for t in ("Fine text.", "Broken text."))
    real = engine.talker.audio.logits

    def poisoned(hidden):
        out = real(hidden)
        out[-1, 3, 7] = float("nan")  # the last row of the step is the second stream's
        return out

    monkeypatch.setattr(engine.talker.audio, "logits", poisoned)
    events = engine.step()  # both prompts in one prefill step: row 0 sampled for each
    assert [(e.stream_id, e.finished, e.reason) for e in events if e.finished] == [(bad, True, "error")]
    assert [e for e in events if e.stream_id == good] == []  # row 0 completes no frame (row 7 completes frame 0)
    assert engine.num_active == 1 and engine.cache.allocator.active_seqs == [good]
