"""The CPU pipeline benchmark (higgs_stream/bench_pipeline.py): a short run completes every stream, its
fake engine makes the GIL-dropping calls it is asked for, and a run's switch interval is its own."""

import asyncio
import sys

import pytest
from higgs_stream import bench_pipeline


def test_a_short_run_with_gil_dropping_calls_and_its_own_switch_interval(monkeypatch):
    made = []
    real = bench_pipeline.FakeEngine

    def engine(*args, **kw):
        made.append(real(*args, **kw))
        return made[-1]

    monkeypatch.setattr(bench_pipeline, "FakeEngine", engine)
    before = sys.getswitchinterval()
    res, _ = asyncio.run(bench_pipeline.run(streams=4, frames=20, releases=5, switch_ms=0.5, ramp_repeat=2))
    assert res.streams == 4 and res.audio_s == pytest.approx(4 * 20 * 960 / 24000)
    assert made[0]._scratch[0].item() == 5 * made[0].steps  # five tiny torch calls per step
    assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)  # restored (CPython keeps whole microseconds)
