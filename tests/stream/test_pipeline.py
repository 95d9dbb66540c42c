"""The asyncio pipeline on the tiny random checkpoint (CPU): streamed PCM equals offline
synthesis (s16 within 1 LSB, equal length), segments chain their history, cancel/slow clients free KV pages.
Its threads and scheduling on a fake engine and codec: test_pipeline_threads.py."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import re

import numpy as np
import pytest
import soundfile as sf
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import CapacityError, HiggsStreamError, InvalidInputError
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
from higgs_stream.engine.synth import synthesize
from higgs_stream.stream.adapter import to_s16le
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.handle import Audio, End
from higgs_stream.stream.messages import ContextOptions
from higgs_stream.stream.pipeline import Pipeline, WarmUpError
from higgs_stream.stream.voices import VoiceLibrary
from higgs_stream.testing import assert_pcm_close, collect, default_voice
from higgs_stream.testing_server import pages_freed, tiny_codec_engine, wait_until

MAX_FRAMES = 30


codec, engine = tiny_codec_engine(kv_pages=512)


@pytest.fixture(scope="module")
def ref_engine(tiny_ckpt):
    """A second engine for offline references (the pipeline's engine is driven by its thread)."""
    return Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(kv_pages=512))


@pytest.fixture
async def make_pipeline(engine, codec):
    started = []

    async def make(**cfg) -> Pipeline:
        cfg.setdefault("max_frames", MAX_FRAMES)
        p = Pipeline(engine, codec, ServerConfig(**{"admit_step_ratio": None, **cfg}))  # load admission: its own tests
        await p.start()
        started.append(p)
        return p

    yield make
    for p in started:
        await p.stop()
    assert engine.cache.allocator.num_used == 0, "KV pages leaked"



def reference_pcm(ref_engine, codec, text, seed, **kw) -> bytes:
    req = GenerationRequest(text, sampling=SamplingParams(seed=seed), max_frames=MAX_FRAMES, **kw)
    wav, _ = synthesize(ref_engine, codec, req)
    return to_s16le(wav)


async def say_once(p: Pipeline, text: str, seed: int, mode: str) -> tuple[bytes, End]:
    """One context saying `text` then closing: its PCM and its end."""
    h = p.open(ContextOptions(voice=default_voice(), seed=seed, mode=mode))
    h.say(text)
    h.close()
    return await collect(h)


async def test_stream_equals_offline_synthesis(make_pipeline, ref_engine, codec, engine):
    expected = reference_pcm(ref_engine, codec, "Hello world.", seed=11)
    assert len(expected) > 0
    p = await make_pipeline()
    pcm, end = await say_once(p, "Hello world.", 11, "exact")
    assert end == End("completed")
    assert_pcm_close(pcm, expected)  # s16le, equal length, within 1 LSB
    assert p.metrics.ttfa.count == 1 and p.metrics.requests.value(transport="ws", outcome="completed") == 1
    # low-latency mode: same tokens, same length, approximate samples
    pcm_ll, _ = await say_once(p, "Hello world.", 11, "low_latency")
    assert len(pcm_ll) == len(expected)
    a = np.frombuffer(pcm_ll, "<i2").astype(np.float64)
    b = np.frombuffer(expected, "<i2").astype(np.float64)
    snr = 10 * np.log10((b**2).sum() / max(((a - b) ** 2).sum(), 1e-9))
    assert snr > 10, f"low-latency SNR {snr:.1f} dB"
    await pages_freed(engine)


async def test_a_repeated_ramp_start_streams_the_same_audio(make_pipeline, ref_engine, codec, engine):
    """ramp_repeat 2 (chunk 1 as large as chunk 0): another chunk schedule, the same exact audio."""
    expected = reference_pcm(ref_engine, codec, "Hello world.", seed=11)
    p = await make_pipeline(ramp_repeat=2)
    assert p.adapter_config("exact").schedule[:3] == (1, 1, 2)
    pcm, end = await say_once(p, "Hello world.", 11, "exact")
    assert end == End("completed")
    assert_pcm_close(pcm, expected)  # s16le, equal length, within 1 LSB
    await pages_freed(engine)


async def test_segments_chain_history_and_seeds(make_pipeline, ref_engine, codec, engine, monkeypatch):
    requests = []
    add = engine.add
    monkeypatch.setattr(engine, "add", lambda req: (requests.append(req), add(req))[1])
    p = await make_pipeline(history_segments=1)
    h = p.open(ContextOptions(voice=default_voice(), seed=5))
    for text in ("First part.", "Second part.", "Third part."):
        h.say(text)
    h.close()
    pcm, end = await collect(h)
    assert end.reason == "completed"
    assert [r.text for r in requests] == ["First part.", "Second part.", "Third part."]
    assert [r.sampling.seed for r in requests] == [5, 6, 7]
    assert requests[0].history == ()
    # segment 2 is conditioned on exactly the codes generated for segment 1 (bounded to 1 segment)
    frames1 = ref_engine.generate(requests[0])
    assert len(requests[1].history) == 1 and requests[1].history[0].transcript == "First part."
    np.testing.assert_array_equal(requests[1].history[0].codes, frames1)
    assert [h_.transcript for h_ in requests[2].history] == ["Second part."]
    # and the streamed audio is the three offline syntheses back to back
    expected = b"".join(to_s16le(synthesize(ref_engine, codec, r)[0]) for r in requests)
    assert_pcm_close(pcm, expected)


async def test_reference_voice_is_encoded_once(make_pipeline, engine, codec, monkeypatch):
    t = np.arange(12000) / 24000
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24000, format="WAV")
    voice = VoiceLibrary().inline(base64.b64encode(buf.getvalue()).decode(), "A short clip.")
    expected_codes = codec.encode(*voice.decode())
    requests = []
    add = engine.add
    monkeypatch.setattr(engine, "add", lambda req: (requests.append(req), add(req))[1])
    p = await make_pipeline()
    handles = [p.open(ContextOptions(voice=voice, seed=i)) for i in range(2)]
    for h in handles:
        h.say("One.")
        h.say("Two.")
        h.close()
    for h in handles:
        assert (await collect(h))[1].reason == "completed"
    assert len(requests) == 4
    for r in requests:
        assert isinstance(r.reference, Reference) and r.reference.transcript == "A short clip."
        np.testing.assert_array_equal(r.reference.codes, expected_codes)
        assert r.history == ()  # a reference voice needs no history
    assert len(p._encodes) == 1  # both contexts shared one encoding


async def test_cancel_frees_pages_within_a_step(make_pipeline, engine):
    p = await make_pipeline(max_frames=2000)
    h = p.open(ContextOptions(voice=default_voice(), seed=3, temperature=1.0))
    h.say("A long sentence that keeps going.")
    async with asyncio.timeout(30):
        first = await h.next(1 << 20)
    assert isinstance(first[0], Audio)
    assert engine.cache.allocator.num_used > 0
    steps = p.steps
    h.cancel()
    assert h.take(1 << 20)[-1] == End("cancelled")  # answered at once, before any step
    await pages_freed(engine)
    assert p.steps - steps <= 2, f"pages freed after {p.steps - steps} steps"
    assert p.active == 0


async def test_every_finished_stream_writes_one_access_log_line(make_pipeline, engine, caplog):
    caplog.set_level(logging.INFO, logger="higgs_stream.access")
    p = await make_pipeline()
    h = p.open(ContextOptions(voice=default_voice(), seed=11), transport="webrtc", stream_id="ctx-1")
    h.say("Hello world.")
    h.close()
    pcm, _ = await collect(h)
    cancelled = p.open(ContextOptions(voice=default_voice(), seed=3), transport="http")  # no id: one is made
    cancelled.cancel()
    lines = [r for r in caplog.records if r.name == "higgs_stream.access"]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in lines)
    done, cut = (r.getMessage() for r in lines)
    m = re.fullmatch(r"webrtc id=ctx-1 reason=completed samples=(\d+) ttfa_ms=(\d+)", done)
    assert m and int(m[1]) == len(pcm) // 2 > 0, done
    assert re.fullmatch(rf"http id={cancelled.stream_id} reason=cancelled samples=0 ttfa_ms=-", cut), cut
    assert re.fullmatch(r"[0-9a-f]{16}", cancelled.stream_id)


async def test_a_stream_is_counted_when_its_client_takes_its_end(make_pipeline, caplog):
    """A stream that ran to its end is `completed` once its client has taken its End (after all its audio), not when
    its last segment ended: one whose client went away before that is `disconnected` (a probe: a context whose
    generation finished before its client dropped was logged completed, its audio never sent)."""
    caplog.set_level(logging.INFO, logger="higgs_stream.access")
    p = await make_pipeline()
    left, read = (p.open(ContextOptions(voice=default_voice(), seed=seed)) for seed in (11, 12))
    for h in (left, read):
        h.say("Hello world.")
        h.close()
    await wait_until(lambda: left.finished and read.finished, 60)  # both Ends queued, nothing taken
    assert p.active == 0 and p.metrics.requests.value(transport="ws", outcome="completed") == 0
    left.cancel("disconnected")  # its client went: the audio it never took is dropped
    assert left.take(1 << 20) == []
    audio = read.take(1 << 30)  # all its audio, not its End: that waits until the transport comes back for it
    assert audio and all(isinstance(ev, Audio) for ev in audio)
    assert p.metrics.requests.value(transport="ws", outcome="completed") == 0
    assert read.take(1 << 30) == [End("completed")]
    assert p.metrics.requests.value(transport="ws", outcome="completed") == 1
    assert p.metrics.requests.value(transport="ws", outcome="disconnected") == 1
    read.cancel("disconnected")  # taken already: counted once
    assert p.metrics.requests.value(transport="ws", outcome="disconnected") == 1
    reasons = [re.search(r"reason=(\w+)", r.getMessage())[1] for r in caplog.records if r.name == "higgs_stream.access"]
    assert reasons == ["disconnected", "completed"]


async def test_a_context_its_client_has_not_read_is_held_then_resumes_unchanged(make_pipeline, ref_engine, codec):
    """Back-pressure (StreamHandle._hold): context b, queued behind a on its connection, is not read while a plays.
    Its generation pauses once 0.2 s of its audio waits (the engine stream paused, no slow_client timer: its client
    has taken none of it yet) and resumes when read; both end completed with the audio of an offline synthesis
    (a queued context ended with slow_client before, found by a probe of a CPU server)."""
    p = await make_pipeline(stream_hold_s=0.2, slow_client_s=0.01)
    a, b = (p.open(ContextOptions(voice=default_voice(), seed=seed)) for seed in (11, 12))
    for h, text in ((a, "Hello world."), (b, "Second context.")):
        h.say(text)
        h.close()
    await wait_until(lambda: b.held and b._segment is not None and b._segment.sid in p.pacer.paused, 30)
    assert b._stall is None and not b.finished  # never taken: not slow, only waiting its turn
    pcm_a, end_a = await collect(a)
    pcm_b, end_b = await collect(b)
    assert end_a == end_b == End("completed") and not b.held
    assert_pcm_close(pcm_a, reference_pcm(ref_engine, codec, "Hello world.", seed=11))
    assert_pcm_close(pcm_b, reference_pcm(ref_engine, codec, "Second context.", seed=12))


async def test_admission_and_slow_client(make_pipeline, engine, caplog):
    caplog.set_level(logging.INFO, logger="higgs_stream.access")
    p = await make_pipeline(max_streams=1, stream_hold_s=0.05, slow_client_s=0.2, max_frames=2000)
    h = p.open(ContextOptions(voice=default_voice(), seed=1))
    with pytest.raises(CapacityError):
        p.open(ContextOptions(voice=default_voice()))
    h.say("Nobody reads this after its first audio.")
    first = await h.next(1 << 20)  # the client takes some audio, then stops reading
    assert isinstance(first[0], Audio)
    await wait_until(lambda: h.finished, 30)  # held at 50 ms queued, not drained for 0.2 s: slow_client
    (end,) = h.take(1 << 20)
    assert end.reason == "error" and end.error.code == "slow_client" and "too little audio" in str(end.error)
    assert p.metrics.slow_clients.value() == 1 and not h.held
    (line,) = [r.getMessage() for r in caplog.records if r.name == "higgs_stream.access"]
    assert re.fullmatch(rf"ws id={h.stream_id} reason=error code=slow_client samples=\d+ ttfa_ms=\d+", line), line
    await pages_freed(engine)
    h2 = p.open(ContextOptions(voice=default_voice()))  # the slot is free again
    h2.cancel()


async def test_a_warm_up_the_model_fails_stops_the_start_and_one_it_refuses_does_not(make_pipeline, engine,
                                                                                      monkeypatch):
    """A warm-up utterance that ended with an error was logged as warmed up and the server served (a probe: NaN
    weights, every request a 500). Now an internal failure (every engine step raises) is a WarmUpError `serve` exits
    with; a refusal of the utterance (a voice the model cannot speak, ...) is logged and the server serves."""
    p = await make_pipeline()

    def refuse(request):
        raise InvalidInputError("this voice needs a reference")

    with monkeypatch.context() as m:
        m.setattr(engine, "add", refuse)
        assert await p.warm_up(default_voice()) is None

    def broken(batch, cache):
        raise RuntimeError("non-finite audio logits")

    with monkeypatch.context() as m:
        m.setattr(engine.talker, "forward", broken)
        with pytest.raises(WarmUpError, match="non-finite audio logits") as e:
            await p.warm_up(default_voice())
    assert e.value.code == "warm_up_failed"
    await pages_freed(engine)
    assert await p.warm_up(default_voice()) is not None  # the model works again: warmed up


async def test_stop_cancels_streams_and_frees_pages(engine, codec):
    p = Pipeline(engine, codec, ServerConfig(max_frames=2000))
    await p.start()
    h = p.open(ContextOptions(voice=default_voice(), seed=3, temperature=1.0))
    h.say("A long sentence that keeps going.")
    async with asyncio.timeout(30):
        await h.next(1 << 20)
    assert engine.cache.allocator.num_used > 0
    await p.stop()
    assert engine.num_active == 0 and engine.cache.allocator.num_used == 0
    assert h.take(1 << 20)[-1] == End("cancelled") and not p.healthy
    with pytest.raises(HiggsStreamError):
        p.open(ContextOptions(voice=default_voice()))


async def test_engine_failure_ends_only_the_affected_stream(make_pipeline, engine, monkeypatch, caplog):
    p = await make_pipeline()
    forward = engine.talker.forward
    calls = {"n": 0}

    def flaky(batch, cache):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fell over")
        return forward(batch, cache)

    monkeypatch.setattr(engine.talker, "forward", flaky)
    h = p.open(ContextOptions(voice=default_voice(), seed=1))
    h.say("Hello there.")
    h.close()
    pcm, end = await collect(h)
    assert pcm == b"" and end.reason == "error" and end.error.code == "internal"
    assert "device fell over" in str(end.error)
    assert "engine step failed" in caplog.text
    await pages_freed(engine)
    # the next stream runs normally and the pipeline stays healthy
    h2 = p.open(ContextOptions(voice=default_voice(), seed=3))
    h2.say("Hello there.")
    h2.close()
    pcm2, end2 = await collect(h2)
    assert end2 == End("completed") and len(pcm2) > 0 and p.healthy


async def test_the_pipeline_sets_the_process_gil_switch_interval(make_pipeline):
    """Serving sets the process-wide GIL switch interval it is configured with (its engine thread's
    calls each drop and retake the GIL; see ServerConfig.gil_switch_s)."""
    import sys

    before = sys.getswitchinterval()
    try:
        await make_pipeline(gil_switch_s=2e-4)
        assert sys.getswitchinterval() == pytest.approx(2e-4, abs=2e-6)  # CPython keeps whole microseconds
    finally:
        sys.setswitchinterval(before)
