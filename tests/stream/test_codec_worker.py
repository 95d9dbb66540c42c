"""The codec worker's deadline-aware batching, without threads or a device: which rounds one call
takes, and when it stops waiting for more."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from higgs_stream.bench_pipeline import FakeCodec
from higgs_stream.stream.codec_worker import CODEC_URGENT_S, CodecWorker, Round


def worker(hold_s: float = 0.05, max_windows: int = 64) -> CodecWorker:
    return CodecWorker(FakeCodec(), cancel=lambda sid: None, deliver=lambda items: None, hold_s=hold_s,
                       max_windows=max_windows)


def rnd(*deadlines: float) -> Round:
    """A round with one (opaque) job per owner; each owner's listener runs dry at `deadline`."""
    owners = [SimpleNamespace(sid=i, deadline=d) for i, d in enumerate(deadlines)]
    return Round(jobs=[object()] * len(owners), owners=owners, ends=[])


def test_hold_waits_only_while_every_listener_has_audio_to_spare():
    w = worker(hold_s=0.05)
    now = time.monotonic()
    until = now + 0.05
    relaxed = [rnd(now + 5.0, now + 2.0)]
    assert 0.04 < w._hold(relaxed, until) <= 0.05  # everyone has seconds of audio: wait for more streams
    assert w._hold([rnd(now + 5.0), rnd(now + CODEC_URGENT_S + 0.01)], until) <= 0.011  # nearly urgent
    assert w._hold([rnd(now + 5.0), rnd(now)], until) < 0  # a first chunk (deadline = now): decode at once
    assert w._hold([Round([], [], [("end", None, "stop", None, None)])], until) == 0.0  # ends only
    assert w._hold(relaxed, now - 0.001) < 0  # the hold is over


def test_collect_takes_everything_queued_up_to_max_windows():
    now = time.monotonic()
    w = worker(hold_s=0.0, max_windows=3)
    for r in (rnd(now + 5), rnd(now + 5, now + 5), rnd(now + 5), rnd(now + 5)):
        w.rounds.put(r)
    first = w._collect()
    assert [len(r.jobs) for r in first] == [1, 2]  # 3 jobs reach max_windows: the rest wait for the next call
    assert [len(r.jobs) for r in w._collect()] == [1, 1]
    w.rounds.put(rnd(now))
    w.rounds.put(None)  # stop: the queued work still goes out first
    assert w._collect()[-1] is None


@pytest.mark.parametrize("urgent", [True, False])
def test_collect_returns_at_once_when_a_listener_is_about_to_run_dry(urgent):
    now = time.monotonic()
    w = worker(hold_s=0.5)
    w.rounds.put(rnd(now if urgent else now + 30))
    t0 = time.monotonic()
    got = w._collect()
    waited = time.monotonic() - t0
    assert len(got) == 1
    if urgent:
        assert waited < 0.4  # no hold: well under the 0.5 s one (a loaded machine may still take a moment)
    else:
        assert waited >= 0.45  # held for the full 0.5 s waiting for more streams, none came


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
