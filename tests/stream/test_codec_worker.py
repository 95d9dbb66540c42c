"""The codec worker's just-in-time batching: which held jobs one call takes and when, without a
device (FakeCodec); and the thread end to end: every segment's audio, then its end, in order."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from higgs_stream.bench_pipeline import FakeCodec
from higgs_stream.stream.codec_worker import (
    CODEC_AHEAD_S,
    CODEC_HOLD_S,
    CODEC_URGENT_S,
    CodecWorker,
    Pending,
    Round,
    due,
    wake_in,
    within_cap,
)
from higgs_stream.engine.errors import ConfigError


def held(seg, *deadlines: float) -> list[Pending]:
    return [Pending(seg, f"job{i}", d) for i, d in enumerate(deadlines)]


def test_nothing_runs_until_a_listener_is_about_to_run_dry():
    now = 100.0
    a, b = SimpleNamespace(sid=1), SimpleNamespace(sid=2)
    relaxed = held(a, now + 2.0, now + 3.0) + held(b, now + 0.9)
    assert due(relaxed, now, set()) == []
    assert wake_in(relaxed, now) == pytest.approx(0.9 - CODEC_URGENT_S)  # b's job turns urgent first
    assert wake_in([], now) is None
    # b turns urgent: the call takes every job needed within CODEC_AHEAD_S, most urgent first
    later = now + 0.9 - CODEC_URGENT_S + 0.01
    got = due(relaxed, later, set())
    assert [(p.seg.sid, p.job) for p in got] == [(2, "job0")] and CODEC_AHEAD_S < 2.0 - (later - now)
    closer = held(a, now + 0.5, now + 0.95, now + 1.2) + held(b, now + 0.2)
    assert [(p.seg.sid, p.job) for p in due(closer, now, set())] == [(2, "job0"), (1, "job0"), (1, "job1")]
    # a first chunk (deadline = its creation time) runs at once
    assert [p.job for p in due(held(a, now), now, set())] == ["job0"]


def test_when_no_stream_is_starting_everything_goes_after_a_short_hold():
    """A lone request (an HTTP download) is not paced: held jobs go as soon as the oldest has waited
    CODEC_HOLD_S for company, or at once when one is urgent."""
    now = 100.0
    a = SimpleNamespace(sid=1)
    pending = [Pending(a, "job0", now + 5.0, taken=now), Pending(a, "job1", now + 9.0, taken=now + 0.01)]
    assert due(pending, now + 0.01, set(), busy=False) == []
    assert wake_in(pending, now + 0.01, busy=False) == pytest.approx(CODEC_HOLD_S - 0.01)
    assert [p.job for p in due(pending, now + CODEC_HOLD_S + 1e-6, set(), busy=False)] == ["job0", "job1"]
    assert due(pending, now + CODEC_HOLD_S + 1e-6, set(), busy=True) == []  # busy: held until due
    urgent = pending + [Pending(a, "job2", now + 0.1, taken=now + 0.01)]
    assert [p.job for p in due(urgent, now + 0.01, set(), busy=False)] == ["job2", "job0", "job1"]


def test_a_first_chunk_or_a_dry_listener_gets_a_call_of_urgent_jobs_only():
    """Busy or not: with a job overdue the call takes only what is urgent (ordered by deadline); the
    rest go in the next call."""
    now = 100.0
    a, b, c = SimpleNamespace(sid=1), SimpleNamespace(sid=2), SimpleNamespace(sid=3)
    other = [Pending(a, "job0", now + 0.6, taken=now - 1.0), Pending(a, "job1", now + 0.9, taken=now - 1.0)]
    first = [Pending(b, "job0", now, taken=now), Pending(b, "job1", now + 0.04, taken=now)]  # a newcomer's
    near = [Pending(c, "job0", now + 0.2, taken=now - 1.0)]
    for busy in (False, True):
        got = due(other + first + near, now, set(), busy=busy)
        assert [(p.seg.sid, p.job) for p in got] == [(2, "job0"), (2, "job1"), (3, "job0")]
    assert [p.job for p in due(other, now, set(), busy=False)] == ["job0", "job1"]  # no newcomer: all, as before
    dry = [Pending(a, "job0", now - 0.05, taken=now - 1.0)] + other[1:]
    assert [p.job for p in due(dry, now, set(), busy=False)] == ["job0"]


def test_an_ended_segment_flushes_its_jobs():
    now = 100.0
    a, b = SimpleNamespace(sid=1), SimpleNamespace(sid=2)
    pending = held(a, now + 5.0, now + 6.0) + held(b, now + 4.0)
    assert due(pending, now, set()) == []
    assert [(p.seg.sid, p.job) for p in due(pending, now, {id(a)})] == [(1, "job0"), (1, "job1")]


def test_a_first_chunk_call_leaves_an_ended_segments_later_jobs_to_the_next_call():
    """An ended segment's held jobs do not ride with a newcomer's first chunk unless they are urgent
    themselves; the next call (no job overdue then) flushes them."""
    now = 100.0
    a, b = SimpleNamespace(sid=1), SimpleNamespace(sid=2)
    ended = [Pending(a, "job0", now + 0.1, taken=now - 1.0), Pending(a, "job1", now + 1.5, taken=now - 1.0)]
    first = [Pending(b, "job0", now, taken=now)]
    for busy in (False, True):
        got = due(ended + first, now, {id(a)}, busy=busy)
        assert [(p.seg.sid, p.job) for p in got] == [(2, "job0"), (1, "job0")]
        assert [(p.seg.sid, p.job) for p in due(ended[1:], now, {id(a)}, busy=busy)] == [(1, "job1")]
        assert wake_in(ended[1:], now, busy, flush={id(a)}) == 0.0  # and that call comes at once
    assert wake_in(ended[1:], now, busy=True) == pytest.approx(1.5 - CODEC_URGENT_S)  # without the flush: later


class StubCode2Wav:
    """Code2Wav's interface: job (seg, k) decodes to 4 samples of value 0.001 * (10 * seg.sid + k)."""

    def __init__(self) -> None:
        self.calls: list[list] = []
        self.owners: list[list] = []
        self.released: list[int] = []

    def run(self, owners, jobs):
        self.calls.append(list(jobs))
        self.owners.append(list(owners))
        return [np.full(4, 0.001 * (10 * seg.sid + k), np.float32) for seg, k in zip(owners, jobs)]

    def release(self, seg) -> None:
        self.released.append(seg.sid)


def test_the_thread_holds_relaxed_jobs_and_flushes_a_segment_at_its_end():
    """Through the real thread, while streams are starting (busy): a first chunk goes out at once; jobs
    needed in 30 s are held (a later urgent call does not take them); a segment's end flushes its held
    jobs, then follows them."""

    async def main() -> tuple[list, StubCode2Wav]:
        got: list[tuple] = []
        arrived = asyncio.Event()

        def deliver(items: list[tuple]) -> None:
            for item in items:
                got.append((item[0], item[1].sid, item[2] if item[0] == "end" else item[2][:2]))
            arrived.set()

        w = CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=deliver, warm=False, busy=lambda: True)
        w.code2wav = stub = StubCode2Wav()
        await w.start(None)
        a, b, c = (SimpleNamespace(sid=i) for i in (1, 2, 3))

        async def until(n: int) -> None:
            while len(got) < n:
                arrived.clear()
                await asyncio.wait_for(arrived.wait(), 5.0)

        now = time.monotonic()
        w.submit(Round([0], [a], [], [now]), timeout=1.0)  # a's first chunk
        await until(1)
        w.submit(Round([1, 0], [a, b], [], [now + 30, now + 30]), timeout=1.0)  # relaxed
        w.submit(Round([0], [c], [], [time.monotonic()]), timeout=1.0)  # urgent: its call leaves the relaxed
        await until(2)
        w.submit(Round([], [], [("end", a, "stop", None, None), ("end", b, "stop", None, None)], []), timeout=1.0)
        await until(6)
        await w.stop(5.0)
        return got, stub

    got, stub = asyncio.run(main())
    s16 = lambda v: int(round(v * 32767)).to_bytes(2, "little", signed=True)
    assert got[0] == ("audio", 1, s16(0.010)) and got[1] == ("audio", 3, s16(0.030))
    assert stub.calls[:2] == [[0], [0]]  # the relaxed jobs were held through c's call
    rest = got[2:]
    assert [x for x in rest if x[1] == 1] == [("audio", 1, s16(0.011)), ("end", 1, "stop")]
    assert [x for x in rest if x[1] == 2] == [("audio", 2, s16(0.020)), ("end", 2, "stop")]
    assert sorted(stub.released) == [1, 2]


def test_frame_buckets_fit_the_ramp_the_steady_chunk_and_its_final_push():
    from higgs_stream.engine.codec.geometry import CodecGeometry
    from higgs_stream.stream.codec_worker import frame_buckets

    v2 = CodecGeometry(num_codebooks=8, codebook_size=1024, hop=960, sample_rate=24000, receptive_field=10,
                       lookahead_samples=9458, causal=False)
    assert v2.lookahead_frames == 10
    assert frame_buckets(v2, 25) == (1, 2, 4, 8, 16, 25, 35)
    causal = CodecGeometry(num_codebooks=16, codebook_size=2048, hop=1920, sample_rate=24000, receptive_field=0,
                           lookahead_samples=0, causal=True)
    assert frame_buckets(causal, 16) == (1, 2, 4, 8, 16)


def test_a_backlog_goes_one_call_at_a_time_so_a_first_chunk_is_not_queued_behind_it():
    """Not busy, max_windows 2: five streams' held jobs are due; each pass decodes the two most urgent
    and leaves the rest held, so a first chunk that arrives after the first call goes in the second
    (alone: the others are not urgent)."""
    got: list[list[int]] = []
    w = CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, warm=False, max_windows=2)
    w.code2wav = stub = StubCode2Wav()
    w._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, items: fn(items))
    now = time.monotonic()
    segs = [SimpleNamespace(sid=i) for i in range(6)]
    w.pending = [Pending(segs[i], 0, now + 1.0 + i, taken=now - 1.0) for i in range(5)]
    w._decode_due()
    got.append([seg.sid for seg, _ in zip(*_last(stub))])
    w.pending.append(Pending(segs[5], 0, now, taken=now))  # a first chunk (deadline = now)
    w._decode_due()
    got.append([seg.sid for seg, _ in zip(*_last(stub))])
    w._decode_due()
    got.append([seg.sid for seg, _ in zip(*_last(stub))])
    w._decode_due()
    got.append([seg.sid for seg, _ in zip(*_last(stub))])
    assert got == [[0, 1], [5], [2, 3], [4]] and w.pending == []


def test_calls_take_the_calm_streams_until_the_codec_falls_behind():
    """calm_windows 2, max_windows 4 (steady chunk 25: behind past 4 x 25 = 100 held frames): six due streams of
    10 frames each (60 held) go 2 a call; of 30 frames each (180 held) 4, then the last two (60 held) 2. A stop's
    flush takes max_windows a call. With no calm_windows every call takes max_windows."""
    def worker(**kw) -> CodecWorker:
        w = CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, warm=False, max_windows=4,
                        **kw)
        w.code2wav = SimpleNamespace(steps=1, run=stub.run, release=stub.release)
        w._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, items: fn(items))
        return w

    def hold(w: CodecWorker, frames: int) -> None:
        now = time.monotonic()
        job = SimpleNamespace(codes=np.zeros((8, frames), np.int64))
        w.pending = [Pending(SimpleNamespace(sid=i), job, now + 1.0 + i, taken=now - 1.0) for i in range(6)]

    def streams_per_call(w: CodecWorker, everything: bool = False) -> list[int]:
        start = len(stub.owners)
        while w.pending:
            w._decode_due(everything)
        return [len(o) for o in stub.owners[start:]]

    class Stub(StubCode2Wav):
        def run(self, owners, jobs):
            return super().run(owners, [0] * len(jobs))

    stub = Stub()
    w = worker(calm_windows=2)
    assert (w.calm_windows, w.behind_frames) == (2, 100)
    hold(w, 10)
    assert w.held_frames() == 60
    assert streams_per_call(w) == [2, 2, 2]
    hold(w, 30)
    assert streams_per_call(w) == [4, 2]
    hold(w, 10)
    assert streams_per_call(w, everything=True) == [4, 2]
    w = worker()
    assert w.calm_windows == 4
    hold(w, 10)
    assert streams_per_call(w) == [4, 2]
    assert worker(calm_windows=9).calm_windows == 4  # never above the largest call
    with pytest.raises(ConfigError, match="codec_calm_windows"):
        worker(calm_windows=0)


def test_only_calls_holding_an_overdue_job_are_marked_for_the_first_stream():
    """The trace's 7th field says whether a call held an overdue job (a first chunk, a dry listener):
    those calls, and only those, run on the highest-priority stream with `overdue_first` on CUDA. The 8th, and
    `on_call`, give the frames still held after the call (the backlog: /metrics' higgs_codec_backlog_frames); the 9th
    how late its most overdue job was when it began."""
    w = CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, warm=False, max_windows=2,
                    busy=lambda: True)  # streams starting: jobs due later stay held
    w.code2wav = SimpleNamespace(steps=1, run=lambda owners, jobs: [np.zeros(4, np.float32) for _ in jobs])
    w._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, items: fn(items))
    w.trace, calls = [], []
    w.on_call = lambda seconds, held, late: calls.append((seconds, held, late))
    now = time.monotonic()
    a, b = SimpleNamespace(sid=0), SimpleNamespace(sid=1)
    job = SimpleNamespace(codes=np.zeros((8, 1), np.int64))
    relaxed = SimpleNamespace(codes=np.zeros((8, 5), np.int64))
    w.pending = [Pending(a, job, now + 0.1, taken=now - 1.0), Pending(b, relaxed, now + 20, taken=now)]  # urgent, not overdue
    w._decode_due()
    w.pending = [Pending(b, job, now - 0.5, taken=now), Pending(a, job, now + 0.2, taken=now - 1.0)]  # b's first chunk,
    w._decode_due()  # made 0.5 s ago
    elapsed = time.monotonic() - now
    assert [(len(t), t[3], t[6], t[7]) for t in w.trace] == [(9, 1, False, 5), (9, 2, True, 0)]
    assert [held for _, held, _ in calls] == [5, 0] and all(s >= 0 for s, _, _ in calls)
    assert calls[0][2] is None and calls[1][2] == w.trace[1][8]  # on_call: the lateness of overdue calls only
    # the 9th: how long past its deadline the call's most overdue job was when the call began (0: none overdue)
    assert w.trace[0][8] == 0.0 and 0.5 <= w.trace[1][8] <= 0.5 + elapsed
    assert w._first is None  # no device: nothing to switch to


def test_overdue_first_needs_the_codec_on_its_own_plain_stream():
    for bad in ({"stream_mode": "engine"}, {"codec_sms": 32}):
        with pytest.raises(ConfigError, match="codec_overdue_first"):
            CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, overdue_first=True, **bad)
    assert CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, overdue_first=True).overdue_first


def _last(stub: "StubCode2Wav") -> tuple[list, list]:
    return stub.owners[-1], stub.calls[-1]


def test_a_green_context_needs_the_codec_on_its_own_stream():
    with pytest.raises(ConfigError, match="codec_sms"):
        CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, stream_mode="engine", codec_sms=32)
    assert CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, codec_sms=32).codec_sms == 32


def frames_job(n: int) -> SimpleNamespace:
    return SimpleNamespace(codes=np.zeros((16, n), np.int64))


def at_most(frames: int):
    return lambda n: n <= frames


def test_within_cap_takes_the_most_urgent_prefix_and_at_least_one_job():
    a, b = SimpleNamespace(sid=0), SimpleNamespace(sid=1)
    now = 0.0  # every deadline beyond CODEC_URGENT_S: the cap alone decides
    take = [Pending(a, frames_job(4), 1.0), Pending(b, frames_job(3), 2.0), Pending(a, frames_job(2), 3.0)]
    assert within_cap(take, at_most(7), now) == take[:2] and within_cap(take, at_most(9), now) == take
    assert within_cap(take, at_most(6), now) == take[:1]
    big = [Pending(a, frames_job(25), 1.0)]
    assert within_cap(big, at_most(8), now) == big  # never empty


def test_within_cap_never_leaves_an_urgent_job_behind():
    """A burst of arrivals keeps some stream starting: urgent jobs (listeners about to run dry) all go,
    however many frames they hold; only the jobs after them are cut at the cap."""
    a, b, c = (SimpleNamespace(sid=i) for i in range(3))
    now = 50.0
    soon = now + CODEC_URGENT_S / 2
    take = [Pending(a, frames_job(10), now - 0.1), Pending(b, frames_job(10), soon),
            Pending(c, frames_job(2), now + 1.0), Pending(a, frames_job(2), now + 2.0)]
    assert within_cap(take, at_most(8), now) == take[:2]  # 20 urgent frames past the cap of 8; nothing more
    assert within_cap(take, at_most(22), now) == take[:3]  # room for one more after them
    assert within_cap(take, at_most(100), now) == take


def test_within_cap_exempts_only_jobs_due_within_exempt_s():
    """A shorter exemption (codec_starting_exempt_s) cuts a burst where every job is urgent: the jobs due within it
    all go, the later urgent ones only while the call fits, in deadline order."""
    a, b, c = (SimpleNamespace(sid=i) for i in range(3))
    now = 50.0
    take = [Pending(a, frames_job(10), now - 0.1), Pending(b, frames_job(10), now + 0.05),
            Pending(c, frames_job(10), now + 0.2), Pending(a, frames_job(10), now + 0.25)]
    assert within_cap(take, at_most(8), now) == take  # all within CODEC_URGENT_S: the cap cuts nothing
    assert within_cap(take, at_most(8), now, exempt_s=0.1) == take[:2]  # overdue and due in 50 ms go; the rest wait
    assert within_cap(take, at_most(30), now, exempt_s=0.1) == take[:3]  # room for one more after them
    assert within_cap(take, at_most(8), now, exempt_s=0.0) == take[:1]  # the overdue one, at least one job
    with pytest.raises(ConfigError, match="codec_starting_exempt_s"):
        CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, warm=False, starting_s=0.02,
                    starting_exempt_s=0.5)


def test_while_a_stream_starts_calls_hold_to_the_time_cap():
    """Eager schedule (not busy), three streams' 6-frame jobs held past the hold time, calls measured at 1 ms a
    frame: with a stream waiting for its first audio and codec_starting_ms 8, each call takes one of them (6 ms;
    two would take 12), so a first chunk that arrives after the first call goes in the second, first; with no
    stream starting, one call takes everything."""
    starting = [True]
    w = CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, warm=False,
                    starting=lambda: starting[0], starting_s=0.008)
    for frames in (1, 4, 8, 16) * 5:
        w.call_model.observe(frames, 0.001 * frames)
    w.code2wav = stub = StubCode2Wav()
    w._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, items: fn(items))
    now = time.monotonic()
    segs = [SimpleNamespace(sid=i) for i in range(4)]
    jobs = {i: frames_job(6 if i < 3 else 1) for i in range(4)}
    w.pending = [Pending(segs[i], jobs[i], now + 1.0 + i, taken=now - 1.0) for i in range(3)]
    w._decode_due()
    assert _last(stub)[0] == [segs[0]]
    w.pending.append(Pending(segs[3], jobs[3], now, taken=now))  # a first chunk (1 frame, deadline now)
    w._decode_due()
    assert _last(stub)[0] == [segs[3]]  # urgent jobs only beside an overdue one: segs 1, 2 are 1.5+ s away
    starting[0] = False
    w._decode_due()
    assert _last(stub)[0] == [segs[1], segs[2]] and w.pending == []


def test_a_time_cap_holds_calls_to_the_frames_their_fitted_time_allows():
    """codec_starting_ms: the worker fits its calls' seconds against their frames (a fixed cost + a cost per frame,
    here 5 ms + 0.5 ms a frame, Qwen3-TTS's decoder on an H100) and, while a stream starts, a call takes the frames
    that fit the budget; before any call, and with no cap, everything fits."""
    w = CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, warm=False, starting_s=0.02)
    assert w._fits(10_000)  # no call measured yet: no prediction, no cap
    for frames in (4, 40, 10, 80, 20, 160) * 5:
        w.call_model.observe(frames, 0.005 + 0.0005 * frames)
    assert w._fits(29) and not w._fits(32)  # 19.5 ms; 21 ms (the fit's ridge: a hair above the line below its mean)
    a = SimpleNamespace(sid=0)
    take = [Pending(a, frames_job(20), 1.0), Pending(a, frames_job(8), 2.0), Pending(a, frames_job(8), 3.0)]
    assert within_cap(take, w._fits, 0.0) == take[:2]
    with pytest.raises(ConfigError, match="codec_starting_ms"):
        CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, warm=False, starting_s=0.0)


def test_with_a_time_cap_the_worker_measures_its_calls():
    """Each decode call feeds the time cap's model (frames, seconds): two calls, two observations."""
    w = CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, warm=False,
                    starting=lambda: True, starting_s=1.0)
    w.code2wav = StubCode2Wav()
    w._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, items: fn(items))
    now = time.monotonic()
    segs = [SimpleNamespace(sid=i) for i in range(2)]
    for i in range(2):
        w.pending = [Pending(segs[i], frames_job(3 + i), now - 1.0, taken=now - 1.0)]
        w._decode_due()
    assert w.pending == [] and w.call_model._w > 1.9 and w.call_model._x > 6.9  # 2 calls, 3 + 4 frames
    assert w.call_model.predict(5) is not None


def test_the_warm_up_runs_every_shape_once_eagerly_then_keeps_open_streams_intact():
    """`warm_up` as a server runs it (a memory headroom set; on a CPU codec the bounds are no-ops and nothing is
    graphed): the plan-picking pass (`run_padding_steps` and every ramp window of every plan in `ramp_configs`: the
    idle ramp's and the loaded windows of first chunks 2 and 3) then `capture`; the count is every stateful bucket and
    every window shape, and a stream open across the warm-up still decodes exactly (padding rows touch only the
    scratch slot)."""
    import torch

    from higgs_stream.engine.codec import Codec, CodecConfig
    from higgs_stream.engine.codec.make import build_reference_model
    from higgs_stream.engine.codec.load import codec_from_state_dict
    from higgs_stream.stream.chunking import loaded_config
    from higgs_stream.stream.codec_worker import CODEC_BATCH_BUCKETS, CODEC_WINDOW_BUCKETS
    from higgs_stream.testing import EXACT_REL_TO_PEAK, rel_to_peak

    cfg = CodecConfig.tiny()
    codec: Codec = codec_from_state_dict(build_reference_model(cfg, seed=7).state_dict(), cfg, with_encoder=False)
    w = CodecWorker(codec, cancel=lambda sid: None, deliver=lambda items: None, graphs=False, max_streams=32,
                    memory_headroom_gb=16.0, ramp_configs=[loaded_config("low_latency", f, 2, 25) for f in (1, 2, 3)])
    dec = w.code2wav.streaming
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, codec.geometry.codebook_size, (codec.geometry.num_codebooks, 30), generator=gen)
    slot = dec.open()
    first = dec.push([slot], codes[None, :, :12], [12], [False])[0].clone()
    windows, steps, decode, run_steps = [], [], codec.decode, dec.run_padding_steps
    codec.decode = lambda c: windows.append(tuple(c.shape)) or decode(c)  # the ramp windows' one-shot decodes
    dec.run_padding_steps = lambda b, f: steps.append((tuple(b), tuple(f))) or run_steps(b, f)
    count = w.warm_up()
    (batches, frames), = steps  # one plan-picking pass over every stateful bucket
    assert batches == CODEC_BATCH_BUCKETS and set(dec._buckets) == {(b, c) for b in batches for c in frames}
    assert not dec.graphed
    lengths = {s[2] for s in windows}
    assert lengths == {5, 7, 11, 21, 34} | {2 + 4, 3 + 4} and set(windows) == {(b, codec.geometry.num_codebooks, n) for b in CODEC_WINDOW_BUCKETS
                                        for n in lengths}
    assert count == len(batches) * len(frames) + len(windows)
    rest = dec.push([slot], codes[None, :, 12:], [18], [True])[0].clone()
    want = codec.decode(codes[None])[0]
    assert rel_to_peak(torch.cat([first, rest]).numpy(), want.numpy()) <= EXACT_REL_TO_PEAK


def test_the_warm_up_prepares_only_the_batch_buckets_a_call_can_fill():
    """A call decodes at most `max_windows` streams, one stateful row each, so the warm-up prepares (and a GPU worker
    graphs) the batch buckets up to the smallest holding that many: the Higgs families' 32 skip the 64-row bucket;
    64 and more keep every bucket. A stop's flush of 40 held streams at 32 a call runs as calls of 32 and 8."""
    from higgs_stream.engine.codec import Codec, CodecConfig
    from higgs_stream.engine.codec.load import codec_from_state_dict
    from higgs_stream.engine.codec.make import build_reference_model
    from higgs_stream.stream.codec_worker import CODEC_BATCH_BUCKETS, batch_buckets

    assert batch_buckets(1) == (1,) and batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert batch_buckets(33) == batch_buckets(64) == batch_buckets(500) == CODEC_BATCH_BUCKETS
    cfg = CodecConfig.tiny()
    codec: Codec = codec_from_state_dict(build_reference_model(cfg, seed=7).state_dict(), cfg, with_encoder=False)
    w = CodecWorker(codec, cancel=lambda sid: None, deliver=lambda items: None, graphs=False, max_windows=32,
                    max_streams=64, memory_headroom_gb=16.0)
    dec, steps = w.code2wav.streaming, []
    dec.run_padding_steps = lambda b, f: steps.append(tuple(b)) or 0
    w.warm_up()
    assert steps == [(1, 2, 4, 8, 16, 32)] and {b for b, _ in dec._buckets} == {1, 2, 4, 8, 16, 32}
    flush = CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, warm=False, max_windows=32)
    flush.code2wav = stub = StubCode2Wav()
    flush._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, items: fn(items))
    now = time.monotonic()
    flush.pending = [Pending(SimpleNamespace(sid=i), 0, now + 5.0, taken=now) for i in range(40)]
    flush._decode_due(everything=True)
    assert [len({id(o) for o in owners}) for owners in stub.owners] == [32, 8] and flush.pending == []


def test_the_warm_up_turns_cudnn_off_when_its_graphs_disagree_with_native_convolutions(caplog):
    """When the captured graphs differ from the same steps on PyTorch's native convolutions by more than
    NATIVE_TOLERANCE (a wrong cuDNN plan: engine/gpu_memory.py), the warm-up turns cuDNN off for the codec, captures
    again and checks again; within it (the opt-in TF32 codec: within NATIVE_TOLERANCE_TF32), cuDNN stays on and the
    check is logged."""
    from higgs_stream.engine.codec import Codec, CodecConfig
    from higgs_stream.engine.codec.load import codec_from_state_dict
    from higgs_stream.engine.codec.make import build_reference_model
    from higgs_stream.stream.codec_worker import NATIVE_TOLERANCE, NATIVE_TOLERANCE_TF32

    cfg = CodecConfig.tiny()
    for checks, tf32, cudnn, captures in (([0.2, 1e-6], False, False, 2), ([1e-6], False, True, 1),
                                          ([5e-3], True, True, 1)):  # the opt-in TF32 codec: ~1e-3 is its own error
        codec: Codec = codec_from_state_dict(build_reference_model(cfg, seed=7).state_dict(), cfg, with_encoder=False)
        codec.allow_tf32 = tf32
        w = CodecWorker(codec, cancel=lambda sid: None, deliver=lambda items: None, graphs=False)
        dec, calls, left = w.code2wav.streaming, [], list(checks)
        dec.run_padding_steps = lambda b, f: 0
        dec.capture = lambda *a, **k: calls.append(codec.cudnn) or dec._graphs.update({(1, 1): None}) or 0.0
        dec.check_against_native = lambda: left.pop(0)
        with caplog.at_level("INFO"):
            w.warm_up()
        assert codec.cudnn is cudnn and calls == [True, False][:captures] and not left
        assert w.native_check == checks[-1] <= (NATIVE_TOLERANCE_TF32 if tf32 else NATIVE_TOLERANCE)
        assert w.health() == {"cudnn": None, "native_check": checks[-1]}  # a CPU codec: cuDNN does not apply
        w.device = "cuda"  # what /healthz shows of a GPU codec (only whether there is a device is read)
        assert w.health() == {"cudnn": cudnn, "native_check": checks[-1]}
    assert "cuDNN is off for the codec" in caplog.text and "native convolutions: max |d| 1e-06" in caplog.text
