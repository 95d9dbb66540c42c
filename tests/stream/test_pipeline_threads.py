"""The pipeline's threads and scheduling on a fake engine and codec (higgs_stream/bench_pipeline.py, CPU):
the engine steps while the codec works and every stream keeps its order, a full codec queue holds the
engine back, a codec failure ends only its call's streams, pacing (pauses while saturated, yielding to a
newcomer, never synchronous steps under an HTTP download), load admission, the first chunk's jitter
sizing, and the warm-up before a server reports healthy. The same pipeline on the tiny checkpoint:
test_pipeline.py."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.errors import CapacityError, ConfigError
from higgs_stream.stream.adapter import to_s16le
from higgs_stream.stream.chunking import LOADED_RAMP, AdapterConfig, window_lengths
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.handle import End, StreamHandle
from higgs_stream.stream.messages import ContextOptions
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.testing import collect, default_voice

def fake_pcm(engine, sid: int) -> bytes:
    """What the frame-local FakeCodec makes of stream `sid`'s frames: code 0 / 2048, held for a frame."""
    frames = engine.frames[sid]  # [8, F]
    return to_s16le(np.repeat(frames[0].astype(np.float32) / np.float32(2048.0), 960))


class GatedCodec:
    """FakeCodec whose calls wait for `gate`; `fail_call`: the call (1-based) that raises."""

    def __init__(self, fail_call: int | None = None):
        from higgs_stream.bench_pipeline import FakeCodec

        self.inner, self.fail_call = FakeCodec(), fail_call
        self.geometry = self.inner.geometry
        self.gate = threading.Event()
        self.shapes = []

    def streaming_decoder(self, max_slots: int):
        from higgs_stream.bench_pipeline import FrameLocalStreaming

        return FrameLocalStreaming(self.decode, self.geometry, max_slots)

    def decode(self, codes):
        self.gate.wait(30)
        self.shapes.append(tuple(codes.shape))
        if len(self.shapes) == self.fail_call:
            raise RuntimeError("codec fell over")
        return self.inner.decode(codes)


async def fake_pipeline(codec, rounds: int | None = None):
    from higgs_stream.bench_pipeline import FakeEngine

    engine = FakeEngine(step_s=0.001)
    p = Pipeline(engine, codec, ServerConfig(max_frames=60, history_segments=0,
                                             **({} if rounds is None else {"codec_queue_rounds": rounds})))
    assert p.codec_worker.rounds.maxsize == (4 if rounds is None else rounds)  # codec_queue_rounds' default
    await p.start()
    return engine, p


async def test_engine_steps_while_the_codec_works_and_streams_keep_their_order():
    codec = GatedCodec()
    engine, p = await fake_pipeline(codec, rounds=64)  # room for every round of 40 steps (the queue bound: next test)
    try:
        handles = [p.open(ContextOptions(voice=default_voice(), seed=i)) for i in range(3)]
        for h in handles:
            h.say("Hello.")
            h.close()
        async with asyncio.timeout(10):  # the codec is stuck in its first call; generation goes on
            while engine.steps < 40:
                await asyncio.sleep(0.005)
        assert all(h.samples == 0 for h in handles) and len(codec.shapes) == 0
        codec.gate.set()
        for sid, h in enumerate(handles):
            pcm, end = await collect(h, timeout=10)
            assert end == End("completed") and pcm == fake_pcm(engine, sid)
        # rounds queued while the codec was busy were decoded together: fewer calls than rounds
        assert p.codec_calls == len(codec.shapes) < 3 * 7
    finally:
        await p.stop()


async def test_full_codec_queue_holds_the_engine_back():
    codec = GatedCodec()
    engine, p = await fake_pipeline(codec, rounds=1)
    try:
        h = p.open(ContextOptions(voice=default_voice(), seed=1))
        h.say("Hello.")
        h.close()
        async with asyncio.timeout(10):
            while True:  # one round in the codec, one queued, the engine waits on the third
                steps = engine.steps
                await asyncio.sleep(0.1)
                if engine.steps == steps:
                    break
        assert engine.has_work() and steps < 60
        codec.gate.set()
        pcm, end = await collect(h, timeout=10)
        assert end == End("completed") and pcm == fake_pcm(engine, 0)
    finally:
        await p.stop()


async def test_codec_failure_ends_only_the_streams_in_that_call():
    codec = GatedCodec(fail_call=1)
    engine, p = await fake_pipeline(codec)
    codec.gate.set()
    try:
        a = p.open(ContextOptions(voice=default_voice(), seed=1))
        a.say("Hello.")
        a.close()
        pcm, end = await collect(a, timeout=10)
        assert pcm == b"" and end.reason == "error" and "codec fell over" in str(end.error)
        b = p.open(ContextOptions(voice=default_voice(), seed=2))
        b.say("Hello.")
        b.close()
        pcm, end = await collect(b, timeout=10)
        assert end == End("completed") and pcm == fake_pcm(engine, 1) and p.healthy
        async with asyncio.timeout(5):
            while engine.has_work():  # the failed stream was cancelled in the engine
                await asyncio.sleep(0.01)
    finally:
        await p.stop()


async def far_ahead(p: Pipeline, seconds: float = 0.6, transport: str = "ws") -> tuple[StreamHandle, bytes]:
    """A stream (seed 1) read until `seconds` of its audio are out: with a fake engine many times faster than
    real time, it is then far ahead of its listener. Returns it and that audio."""
    first = p.open(ContextOptions(voice=default_voice(), seed=1), transport=transport)
    first.say("Hello.")
    first.close()
    head: list[bytes] = []
    async with asyncio.timeout(20):
        while sum(map(len, head)) < 2 * 24000 * seconds:  # s16 mono, 24 kHz
            for ev in await first.next(1 << 20):
                assert not isinstance(ev, End), f"the stream ended before {seconds} s of audio"
                head.append(ev.pcm)
    return first, b"".join(head)


async def then_a_newcomer(p: Pipeline, first: StreamHandle) -> tuple[bytes, bytes]:
    """A second stream (seed 2) beside `first`; both to the end. Returns the rest of first's audio and the
    second's, each completed."""
    second = p.open(ContextOptions(voice=default_voice(), seed=2))
    second.say("Hello.")
    second.close()
    pcm2, end2 = await collect(second, timeout=20)
    pcm1, end1 = await collect(first, timeout=20)
    assert end1 == end2 == End("completed")
    return pcm1, pcm2


async def test_saturated_engine_pauses_streams_far_ahead_while_another_needs_the_steps():
    """Deadline-aware pacing end to end (fake engine at 12 ms a step: 'saturated' above 10 ms, no
    admission limit): alone, a stream far ahead is never paused (that frees the GPU for nobody);
    while a second stream waits for its first audio, the first (more than 0.3 s ahead of its
    listener) is paused, and it resumes when 0.2 s are left or nobody needs the steps any more
    (never left paused with the talker idle). Both streams' audio is unchanged, nobody stays paused."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    engine = FakeEngine(step_s=0.012)
    pauses: list[int] = []
    engine.pause = lambda sid, pause=engine.pause: (pauses.append(sid), pause(sid))[1]
    cfg = ServerConfig(max_frames=60, history_segments=0, pause_ahead_s=0.3, resume_ahead_s=0.2,
                       admit_step_ratio=None)
    p = Pipeline(engine, FakeCodec(), cfg)
    await p.start()
    try:
        first, head = await far_ahead(p)  # 0.6 s of audio sent at ~3x real time: > 0.3 s ahead
        assert pauses == []  # far ahead, but alone
        pcm1, pcm2 = await then_a_newcomer(p, first)
        assert head + pcm1 == fake_pcm(engine, 0) and pcm2 == fake_pcm(engine, 1)
        # the first is paused first; later either may be (whichever is far ahead while the other is not)
        assert pauses[0] == 0 and not engine.paused and not p.pacer.paused
    finally:
        await p.stop()


async def test_streams_far_ahead_yield_to_a_newcomer_on_an_unsaturated_engine():
    """Yielding end to end (fake engine at 3 ms a step, saturated only above a whole frame a step, so
    pacing alone pauses nobody; 250 frames, ~0.75 s of steps): a stream more than yield_ahead_s ahead
    is paused while a second waits for its first audio, then runs again; both streams' audio is
    unchanged and nobody stays paused."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    engine = FakeEngine(step_s=0.003)
    pauses: list[int] = []
    engine.pause = lambda sid, pause=engine.pause: (pauses.append(sid), pause(sid))[1]
    syncs: list[bool] = []  # relaxed (every stream far ahead, nobody waiting): synchronous engine steps
    engine.step = lambda sync=False, step=engine.step: (syncs.append(sync), step(sync))[1]
    cfg = ServerConfig(max_frames=250, history_segments=0, admit_step_ratio=None, yield_ahead_s=0.3,
                       saturated_step_ratio=1.0)
    p = Pipeline(engine, FakeCodec(), cfg)
    await p.start()
    try:
        first, head = await far_ahead(p)  # 0.6 s of audio sent at many times real time: > 0.3 s ahead
        assert pauses == []  # far ahead, but nobody waits
        pcm1, pcm2 = await then_a_newcomer(p, first)
        assert head + pcm1 == fake_pcm(engine, 0) and pcm2 == fake_pcm(engine, 1)
        assert pauses[0] == 0 and not engine.paused and not p.pacer.paused
        assert syncs[0] is False and True in syncs  # the first steps pipelined (a stream waited), later relaxed
    finally:
        await p.stop()


async def test_an_http_response_is_never_stepped_synchronously():
    """A lone HTTP stream far ahead of its (notional) listener keeps pipelined steps: its client may be
    downloading the audio."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    engine = FakeEngine(step_s=0.003)
    syncs: list[bool] = []
    engine.step = lambda sync=False, step=engine.step: (syncs.append(sync), step(sync))[1]
    p = Pipeline(engine, FakeCodec(), ServerConfig(max_frames=250, history_segments=0, yield_ahead_s=0.3))
    await p.start()
    try:
        first, head = await far_ahead(p, transport="http")
        pcm, end = await collect(first, timeout=20)
        assert end == End("completed") and head + pcm == fake_pcm(engine, 0)
        assert syncs and True not in syncs
    finally:
        await p.stop()


async def test_saturated_engine_refuses_new_streams():
    """With the measured step time (fake engine: 12 ms) above the admission limit (a quarter of a
    40 ms frame), a new stream is refused with CapacityError and counted while one runs; once the
    server is idle again it admits (its loop model learns only from steps)."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    engine = FakeEngine(step_s=0.012)
    p = Pipeline(engine, FakeCodec(), ServerConfig(max_frames=60, history_segments=0, admit_step_ratio=0.25))
    await p.start()
    try:
        h = p.open(ContextOptions(voice=default_voice(), seed=1))
        h.say("Hello.")
        h.close()
        head = await h.next(1 << 20)  # audio: the engine has stepped (and been measured)
        assert head and not isinstance(head[-1], End)
        assert p.loop_model.predict(2) > 0.25 * 0.04  # measured: ~12 ms a step
        with pytest.raises(CapacityError, match="saturated"):
            p.open(ContextOptions(voice=default_voice(), seed=2))
        assert p.metrics.refused.value() == 1
        pcm, end = await collect(h, timeout=20)
        assert end == End("completed") and b"".join(ev.pcm for ev in head) + pcm == fake_pcm(engine, 0)
        again = p.open(ContextOptions(voice=default_voice(), seed=3))  # idle: admitted
        again.cancel()
    finally:
        await p.stop()


async def test_first_chunk_grows_with_the_measured_jitter():
    """Idle: the default schedule (a 1-frame first chunk). Loaded: the first chunk covers three
    times (engine loop + codec call), then doubles to 25 frames; never more than 10 frames (the Higgs families' cap;
    an engine that names no family gets theirs). (The plain doubling ramp
    sized for the recent peak call: ramp_repeat 1, first_chunk_margin 1; the defaults are in the tests below.)"""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    p = Pipeline(FakeEngine(), FakeCodec(), ServerConfig(ramp_repeat=1, first_chunk_margin=1.0))
    assert p.adapter_config("exact").schedule == (1, 2, 4, 8, 16, 25)  # nothing measured yet
    p.loop_model.observe(64, 0.010)
    p.codec_worker.call_s = 0.030  # 3 x 40 ms = 120 ms of jitter = 3 frames
    cfg = p.adapter_config("exact")
    assert cfg.schedule == (3, 6, 12, 24, 25) and cfg.mode == "exact"
    loaded = p.adapter_config("low_latency")  # the fake codec is causal: no windows, exact's plan
    assert loaded.schedule == (3, 6, 12, 24, 25) and loaded.ramp(p.geometry) == ()
    p.codec_worker.call_s = 1.0
    assert p.adapter_config("exact").schedule[0] == 10
    # a long call in flight delays chunk 1 but not chunk 0: 3 frames must cover 6 loops + the call
    p.codec_worker.call_s, p.codec_worker.call_peak_s = 0.010, 0.080  # 3 x 20 ms of mean jitter: 2 frames
    assert p.adapter_config("exact").schedule[0] == 4  # 80 ms / (40 - 2 x 10 ms) = 4 frames
    p.codec_worker.call_peak_s = 0.030
    assert p.adapter_config("exact").schedule[0] == 2  # 30 / 20 = 1.5 -> 2: the mean rule's 2 stands
    p.loop_model.observe(64, 0.030)  # a loop of ~20 ms or more: a frame cannot cover two loops
    p.loop_model.last_s = 0.025
    assert p.adapter_config("exact").schedule[0] == 10


async def test_a_repeated_ramp_start_sizes_the_first_chunk_for_one_chunk_of_steps():
    """ramp_repeat 2: chunk 1 has chunk 0's frames, so chunk 0's audio must cover f engine steps plus the
    longest call (not 2f): a smaller first chunk under the same load, then chunk 0's size again, then doubling."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    p = Pipeline(FakeEngine(), FakeCodec(), ServerConfig(ramp_repeat=2, first_chunk_margin=1.0))
    assert p.adapter_config("exact").schedule == (1, 1, 2, 4, 8, 16, 25)  # idle
    assert p.adapter_config("low_latency").schedule == (1, 2, 4, 8, 16, 25)  # its own ramp
    p.loop_model.observe(64, 0.010)
    p.codec_worker.call_s, p.codec_worker.call_peak_s = 0.010, 0.080
    assert p.adapter_config("exact").schedule == (3, 3, 6, 12, 24, 25)  # 80 ms / (40 - 10 ms) -> 3 (doubling: 4)
    p.loop_model.observe(64, 0.030)
    p.loop_model.last_s = 0.045  # a loop longer than a frame: chunk 1's steps cannot be covered
    assert p.adapter_config("exact").schedule[:2] == (10, 10)  # the cap
    with pytest.raises(ConfigError, match="ramp_repeat"):
        ServerConfig(ramp_repeat=0)


async def test_a_first_chunk_margin_sizes_for_longer_calls_than_the_recent_peak():
    """first_chunk_margin K: chunk 0 must cover chunk 1's steps plus K x the longest recent call (bursts ran calls 2-4x
    any recent one); K 1 is the plain rule; the cap still holds. Low-latency on a non-causal codec (the Higgs
    geometry, which the sizing reads): one window (LOADED_RAMP), and chunk 1 from the stateful decoder waits the
    look-ahead's 10 frames less the window's 4 holdback more steps; idle, its whole ramp."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    higgs = CodecGeometry(num_codebooks=8, codebook_size=1024, hop=960, sample_rate=24000, receptive_field=10,
                          lookahead_samples=9458, causal=False)
    for k, first, ll in ((1.0, 3, 5), (3.0, 8, 10), (2.0, 6, 8)):
        p = Pipeline(FakeEngine(), FakeCodec(), ServerConfig(ramp_repeat=2, first_chunk_margin=k))
        p.geometry = higgs  # what adapter_config sizes from (the fake codec itself is causal)
        assert p.adapter_config("low_latency") == AdapterConfig(mode="low_latency")  # idle
        p.loop_model.observe(64, 0.010)
        p.codec_worker.call_s, p.codec_worker.call_peak_s = 0.010, 0.080
        assert p.adapter_config("exact").schedule[:2] == (first, first)  # ceil(k x 80 ms / (40 - 10 ms)), cap 10
        # low-latency: chunk 1 from the stateful decoder also waits 10 - 4 look-ahead steps
        loaded = p.adapter_config("low_latency")
        assert loaded.schedule[:2] == (ll, ll) and loaded.ramp(higgs) == LOADED_RAMP  # ceil((k x 80 + 6 x 10) / 30)


async def test_the_codec_warms_every_window_a_low_latency_plan_can_decode():
    """The codec worker warms up (and graphs) the ramp windows of every plan `adapter_config` can return in
    low-latency mode (CodecWorker.ramp_configs): the idle ramp's five and the loaded window of each first chunk up to
    the cap, so no load sends a window of an unwarmed shape (a GPU codec's first call at a new shape is slow)."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    higgs = CodecGeometry(num_codebooks=8, codebook_size=1024, hop=960, sample_rate=24000, receptive_field=10,
                          lookahead_samples=9458, causal=False)
    p = Pipeline(FakeEngine(), FakeCodec(), ServerConfig())
    p.geometry = higgs  # what adapter_config sizes from (the fake codec itself is causal)
    warmed = set().union(*(window_lengths(c, higgs) for c in p.codec_worker.ramp_configs))
    assert warmed == {5, 7, 11, 21, 34} | {f + 4 for f in range(2, p.cfg.max_first_chunk + 1)}
    seen = set()
    for loop_ms in (0, 2, 5, 10, 20, 45):
        for peak_ms in (0, 5, 20, 60, 200):
            p.loop_model.last_s = loop_ms / 1e3
            p.codec_worker.call_s, p.codec_worker.call_peak_s = peak_ms / 2e3, peak_ms / 1e3
            seen |= window_lengths(p.adapter_config("low_latency"), higgs)
    assert seen <= warmed and len(seen) >= 6, seen


async def test_each_family_gets_its_own_serving_defaults(caplog):
    """ServerConfig's None: the served family's defaults (config.FAMILY_DEFAULTS): the Higgs families ramp_repeat 2,
    first_chunk_margin 3, first chunks of up to 10 frames, no codec cap and 4 rounds queued for the codec (v2's
    256-stream bursts), codec calls of up to 32 streams (v2's closed-loop TTFA p95, session 27); Qwen3-TTS 1 / 1, up
    to 8 frames, the codec cap 12 ms held while a listener has < 0.2 s of audio (its 20 req/s TTFA), 4 rounds and calls
    of up to 64 streams. A set value wins for any family; 0 turns the cap off."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    def pipeline(arch, **cfg):
        engine = FakeEngine()
        engine.family = SimpleNamespace(arch=arch)
        p = Pipeline(engine, FakeCodec(), ServerConfig(**cfg))
        p.loop_model.observe(64, 0.010)
        p.codec_worker.call_s, p.codec_worker.call_peak_s = 0.010, 0.080
        return p

    for arch in ("v2", "v3", None):  # None: an engine that names no family (the fakes) gets the Higgs defaults
        p = pipeline(arch)
        assert (p.cfg.ramp_repeat, p.cfg.first_chunk_margin) == (2, 3.0)
        assert p.adapter_config("exact").schedule == (8, 8, 16, 25)  # 3 x 80 ms / (40 - 10 ms) = 8
        assert p.cfg.codec_starting_ms is None and p.codec_worker.starting_s is None  # no codec cap
        p.codec_worker.call_peak_s = 0.300  # a burst's calls: the rule asks for 30 frames, the family's cap holds
        assert p.cfg.max_first_chunk == 10 and p.adapter_config("exact").schedule == (10, 10, 20, 25)
        assert p.cfg.codec_queue_rounds == 4 and p.codec_worker.rounds.maxsize == 4
        assert p.cfg.codec_calm_windows == 32 and p.codec_worker.calm_windows == 32  # 32 a call while it keeps up,
        assert p.cfg.codec_max_windows == 64 and p.codec_worker.max_windows == 64  # 64 once it has fallen behind
        assert p.codec_worker.behind_frames == 64 * 25
    with caplog.at_level("INFO", logger="higgs_stream.stream.pipeline"):
        q = pipeline("qwen3-tts")
    assert q.cfg.codec_calm_windows == 64 and (q.codec_worker.calm_windows, q.codec_worker.max_windows) == (64, 64)
    assert ("serving qwen3-tts with ramp_repeat=1, first_chunk_margin=1.0, codec_starting_ms=12.0, max_first_chunk=8, "
            "codec_calm_windows=64, codec_starting_ahead_s=0.2, codec_queue_rounds=4, codec_max_windows=64"
            ) in caplog.text  # operators see it
    v2 = pipeline("v2", codec_max_windows=48, codec_calm_windows=16).codec_worker
    assert (v2.calm_windows, v2.max_windows, v2.behind_frames) == (16, 48, 48 * 25)
    q16 = pipeline("qwen3-tts", codec_max_windows=16).codec_worker
    assert (q16.calm_windows, q16.max_windows) == (16, 16)  # the family's 64 calm streams held to the largest call
    assert q.cfg.codec_queue_rounds == 4 and q.codec_worker.rounds.maxsize == 4  # one default for every family
    assert pipeline("v2", codec_queue_rounds=16).codec_worker.rounds.maxsize == 16
    assert (q.cfg.ramp_repeat, q.cfg.first_chunk_margin) == (1, 1.0)
    assert q.adapter_config("exact").schedule == (4, 8, 16, 25)  # 80 ms / (40 - 2 x 10 ms) = 4
    assert q.codec_worker.starting_s == pytest.approx(0.012) and q.cfg.codec_starting_ahead_s == 0.2
    assert q.codec_worker.starting.__func__ is Pipeline._ramping  # the cap holds through first chunks
    q.codec_worker.call_peak_s = 0.300
    assert q.cfg.max_first_chunk == 8 and q.adapter_config("exact").schedule == (8, 16, 25)
    assert pipeline("v2", max_first_chunk=6).cfg.max_first_chunk == 6
    assert pipeline("qwen3-tts", ramp_repeat=2, first_chunk_margin=3.0).adapter_config("exact").schedule[:2] == (8, 8)
    assert pipeline("v2", ramp_repeat=1, first_chunk_margin=1.0).adapter_config("exact").schedule[0] == 4
    off = pipeline("qwen3-tts", codec_starting_ms=0)  # the family's cap turned off: its ahead goes too
    assert off.codec_worker.starting_s is None and off.cfg.codec_starting_ahead_s is None
    mine = pipeline("qwen3-tts", codec_starting_ms=20)  # a cap of one's own: ahead only where set, as ever
    assert mine.codec_worker.starting_s == pytest.approx(0.02) and mine.cfg.codec_starting_ahead_s is None
    assert pipeline("v2", codec_starting_ms=30, codec_starting_ahead_s=0.3).cfg.codec_starting_ahead_s == 0.3
    for arch, cfg in (("v2", {"codec_starting_ahead_s": 0.3}), ("v2", {"codec_starting_exempt_s": 0.1}),
                      ("qwen3-tts", {"codec_starting_ms": 0, "codec_starting_ahead_s": 0.3})):
        with pytest.raises(ConfigError, match="set codec_starting_ms too"):
            pipeline(arch, **cfg)
    from higgs_stream.engine.models.registry import FAMILIES
    from higgs_stream.stream.config import FAMILY_DEFAULTS

    assert set(FAMILY_DEFAULTS) <= {f.arch for f in FAMILIES}  # every key names a served family (no silent fallback)


async def test_the_first_chunk_grows_under_load_up_to_max_first_chunk():
    """A loop longer than half a frame leaves chunk 0's frames nothing to cover chunk 1's two-chunk-0s of steps: the
    first chunk takes the cap, the configured one (the Higgs families' 10 by default, 8 and 16 here), then doubles from
    there."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    for cap, want in ((None, (10, 20, 25)), (8, (8, 16, 25)), (16, (16, 25))):
        p = Pipeline(FakeEngine(), FakeCodec(), ServerConfig(max_first_chunk=cap, ramp_repeat=1))
        p.loop_model.observe(64, 0.025)
        p.codec_worker.call_s, p.codec_worker.call_peak_s = 0.010, 0.080
        assert p.adapter_config("exact").schedule == want
    with pytest.raises(ConfigError, match="max_first_chunk"):
        ServerConfig(max_first_chunk=0)
    for bad in (0, 2.5, True, None):
        with pytest.raises(ConfigError, match="codec_max_windows"):
            ServerConfig(codec_max_windows=bad)
    for bad in (0, 2.5, True):
        with pytest.raises(ConfigError, match="codec_calm_windows"):
            ServerConfig(codec_calm_windows=bad)


async def test_the_codec_cap_can_hold_while_a_listener_is_in_its_first_chunks():
    """codec_starting_ahead_s: the codec's time cap holds while some stream waits for its first audio (as without it)
    or has less than that much audio left; not once every listener is further ahead."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine
    from higgs_stream.stream.pacing import PlaybackClock

    p = Pipeline(FakeEngine(), FakeCodec(), ServerConfig(codec_starting_ms=30, codec_starting_ahead_s=0.3))
    p._loop = asyncio.get_running_loop()
    now = p.now()
    waiting, ramping, far = PlaybackClock(), PlaybackClock(), PlaybackClock()
    ramping.sent(now - 0.1, 0.32)  # 0.22 s left
    far.sent(now - 1.0, 2.0)  # 1.0 s left
    p._segments = {1: SimpleNamespace(clock=far)}
    assert not p._ramping()
    p._segments[2] = SimpleNamespace(clock=ramping)
    assert p._ramping()
    p._segments = {1: SimpleNamespace(clock=far), 3: SimpleNamespace(clock=waiting)}
    assert p._ramping() and p._starting()
    assert p.codec_worker.starting.__func__ is Pipeline._ramping


def test_the_codec_worker_remembers_its_longest_recent_call():
    """call_peak_s: the longest call, halving every CALL_PEAK_HALF_LIFE_S unless a longer one comes."""
    from higgs_stream.bench_pipeline import FakeCodec
    from higgs_stream.stream.codec_worker import CALL_PEAK_HALF_LIFE_S, CodecWorker

    codec = FakeCodec()
    w = CodecWorker(codec, cancel=lambda sid: None, deliver=lambda items: None, warm=False)
    w._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, items: None)
    clock = iter([10.0, 10.08, 11.0, 11.01, 11.0 + CALL_PEAK_HALF_LIFE_S, 11.0 + CALL_PEAK_HALF_LIFE_S + 0.001])
    with mock.patch("higgs_stream.stream.codec_worker.time.perf_counter", lambda: next(clock)):
        for _ in range(3):
            w._decode_call([])
    assert w.call_peak_s == pytest.approx(max(0.001, 0.08 * 0.5 ** ((11.0 + CALL_PEAK_HALF_LIFE_S + 0.001 - 10.08) / CALL_PEAK_HALF_LIFE_S)))


async def test_warm_up_runs_one_utterance_and_forgets_its_steps():
    """`warm_up` sends one utterance through engine and codec before a server reports healthy, then
    starts the loop model and the codec's call statistics afresh (slow first-use steps must not make admission
    refuse, nor slow first-use calls grow the first requests' first chunks); a warm-up that fails says so and returns
    None instead of keeping the server down."""
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    engine = FakeEngine(step_s=0.0)
    p = Pipeline(engine, FakeCodec(), ServerConfig(max_frames=30, history_segments=0))
    await p.start()
    try:
        seconds = await p.warm_up(default_voice())
        assert seconds is not None and seconds > 0
        assert len(engine.frames[0][0]) == 30  # one whole utterance ran
        assert p.loop_model.predict(1) is None and p.metrics.refused.value() == 0
        worker = p.codec_worker
        assert worker.calls > 0 and worker.call_s == worker.call_peak_s == 0.0 and worker.call_model.predict(25) is None
        assert p.adapter_config("exact").schedule[0] == 1  # the first request: the idle plan
        assert p.metrics.requests.value(transport="warm-up", outcome="completed") == 0  # not a request
        assert await p.warm_up(default_voice(), timeout_s=0.0) is None  # timed out: logged, not raised
    finally:
        await p.stop()


def test_serve_warms_up_unless_told_not_to():
    import argparse

    from higgs_stream.stream.serve_command import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--model", "m"])).warm_up
    assert not config_from_args(parser.parse_args(["--model", "m", "--no-warm-up"])).warm_up


async def test_start_warms_up_with_a_reference_voice_when_the_default_cannot():
    """A model that needs reference audio (Qwen3-TTS Base) fails the default voice's warm-up: the server
    then warms up with the first preset that has a reference, and stops at the first that works."""
    from types import SimpleNamespace

    from higgs_stream.stream.server_state import start_pipeline
    from higgs_stream.stream.voices import Voice

    tried = []

    class Pipe:
        async def start(self):
            tried.append("start")

        async def warm_up(self, voice):
            tried.append(voice.name)
            return None if voice.name == "default" else 1.0

        def mark_serving(self):
            tried.append("serving")

    default = Voice(name="default")
    presets = {"plain": Voice(name="plain"), "ref": Voice(name="ref", audio=b"RIFF", transcript="Hi."),
               "ref2": Voice(name="ref2", audio=b"RIFF", transcript="Hi.")}
    voices = SimpleNamespace(resolve=lambda name: default, presets=presets)
    await start_pipeline(SimpleNamespace(config=ServerConfig(warm_up=True), pipeline=Pipe(), voices=voices))
    assert tried == ["start", "default", "ref", "serving"]
    tried.clear()
    await start_pipeline(SimpleNamespace(config=ServerConfig(), pipeline=Pipe(), voices=voices))
    assert tried == ["start", "serving"]


