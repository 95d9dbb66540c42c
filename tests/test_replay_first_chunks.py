"""scripts/replay_first_chunks.py: the server's first-chunk decision replayed from a trace equals what the pipeline
decides with the same loop and codec history, and the load generator's streams are matched to the server's."""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

from higgs_stream.stream.pacing import LoopModel
from higgs_stream.stream.pipeline import Pipeline

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/replay_first_chunks.py"


def load():
    spec = importlib.util.spec_from_file_location("replay_first_chunks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trace() -> list:
    """40 steps of 64 rows at 15 ms, two codec calls (20 ms, then a long 80 ms one), three streams: one opening before
    any step, two after the long call."""
    ev = [("step", 0.100 + 0.015 * i, 0.110 + 0.015 * i, 0.115 + 0.015 * i, 64, 0.0, 0, 0, False) for i in range(40)]
    ev += [("codec", 0.20, 0.22, 4, 40, 1, False), ("codec", 0.30, 0.38, 30, 700, 2, False)]
    ev += [("stream", 0.05, 0.30, 5.0, 96000), ("stream", 0.45, 0.60, 6.0, 96000), ("stream", 0.46, 0.62, 0.5, 96000)]
    return ev


def test_the_replay_makes_the_pipelines_decision():
    r = load()
    rows = r.replay(trace(), horizon_s=0.5, ramp_repeat=1, first_chunk_margin=1.0)
    assert [row["open"] for row in rows] == [1, 2, 3]  # each counts itself, as the pipeline's handles do
    assert rows[0]["schedule"] == [1, 2, 4]  # nothing observed yet: the idle schedule
    # the same history given to the pipeline's own method
    loop = LoopModel()
    for i in range(40):
        if 0.115 + 0.015 * i <= 0.45:  # the steps that had ended by the second stream's first text
            loop.observe(64, 0.015)
    fade = 0.5 ** ((0.45 - 0.38) / r.CALL_PEAK_HALF_LIFE_S)
    call = SimpleNamespace(call_s=0.05 * 0.02 + 0.05 * (0.08 - 0.05 * 0.02), call_peak_s=0.08 * fade)
    fake = SimpleNamespace(loop_model=loop, geometry=SimpleNamespace(frame_seconds=0.04), codec_worker=call,
                           cfg=SimpleNamespace(max_first_chunk=8, ramp_repeat=1, first_chunk_margin=1.0),
                           _handles=range(2))
    fake._first_chunk = functools.partial(Pipeline._first_chunk, fake)
    want = list(Pipeline.adapter_config(fake, "exact").schedule[:3])
    assert rows[1]["schedule"] == want and want[0] > 1  # under load the first chunk grows
    assert abs(rows[1]["call_peak_s"] - 0.08 * fade) < 1e-12
    assert rows[1]["open_expected"] == 2 + round(2 / r.ARRIVAL_WINDOW_S * 0.5)  # two arrivals in the last second
    assert rows[1]["call_max_after_s"] == 0.0 and abs(rows[1]["loop_after_s"] - 0.015) < 1e-9
    assert abs(rows[1]["step_predicted_s"] - 0.015) < 1e-9 and rows[1]["admitted_by_rule"]  # 15 ms <= 0.5 x 40 ms
    assert rows[0]["step_predicted_s"] is None and rows[0]["admitted_by_rule"]  # an idle server admits
    strict = r.replay(trace(), horizon_s=None, admit_ratio=0.3)  # 12 ms
    assert [row["admitted_by_rule"] for row in strict] == [True, False, False]


def test_a_slower_forgetting_call_peak_makes_later_first_chunks_larger():
    """`peak_half_life_s` (what-if): the long call at 0.38 s fades 0.07 s until the second stream's text; with a longer
    half-life it has faded less there, so the rule's first chunk is at least as large (and the faded peak is exactly
    0.08 x 0.5 ** (0.07 / half-life))."""
    r = load()
    quick = r.replay(trace(), horizon_s=None, ramp_repeat=1, first_chunk_margin=1.0, peak_half_life_s=0.05)
    slow = r.replay(trace(), horizon_s=None, ramp_repeat=1, first_chunk_margin=1.0, peak_half_life_s=5.0)
    for rows, half in ((quick, 0.05), (slow, 5.0)):
        assert abs(rows[1]["call_peak_s"] - 0.08 * 0.5 ** ((0.45 - 0.38) / half)) < 1e-12
    assert slow[1]["schedule"][0] > quick[1]["schedule"][0]
    assert r.replay(trace(), horizon_s=None) == r.replay(trace(), horizon_s=None, peak_half_life_s=r.CALL_PEAK_HALF_LIFE_S)


def test_streams_are_matched_to_the_clients_in_arrival_order():
    r = load()
    rows = r.replay(trace(), horizon_s=None)
    lg = {"scenarios": [{"name": "closed@2", "streams": [
        {"sent": 10.45, "first_audio": 10.60, "underruns": 1, "stalls_at": [0.166]},
        {"sent": 10.46, "first_audio": 10.62, "underruns": 0}]}]}
    r.match(rows, lg, "closed@2")
    assert "underruns" not in rows[0] and rows[1]["underruns"] == 1 and rows[2]["underruns"] == 0
    assert rows[1]["stalls_at"] == [0.166]


def test_the_first_chunk_needed_follows_the_loop_and_call_that_came():
    r = load()
    row = {"loop_after_s": 0.0165, "call_max_after_s": 0.062}
    assert r.needed_first_chunk(row, 1) == 9  # 62 / (40 - 33) = 8.9: chunk 1 twice chunk 0
    assert r.needed_first_chunk(row, 2) == 3  # 62 / (40 - 16.5) = 2.6: chunk 1 as large
    assert r.needed_first_chunk({"loop_after_s": 0.025, "call_max_after_s": 0.01}, 1) == math.inf  # 2 loops > a frame
    assert r.needed_first_chunk({"loop_after_s": None}, 1) is None
    assert r.needed_first_chunk({"loop_after_s": 0.005, "call_max_after_s": 0.0}, 2) == 1


def test_the_replay_makes_a_low_latency_servers_decision():
    """`--mode low_latency`: idle, the whole ramp (no extra steps); under load the one-window plan, its first chunk
    sized for chunk 1's 10 - 4 extra steps as the pipeline sizes it, and the needs replayed with those steps."""
    r = load()
    exact = r.replay(trace(), horizon_s=None, ramp_repeat=1, first_chunk_margin=1.0)
    rows = r.replay(trace(), horizon_s=None, ramp_repeat=1, first_chunk_margin=1.0, mode="low_latency")
    assert rows[0]["schedule"] == [1, 2, 4] and rows[0]["extra_steps"] == 0  # idle: the whole ramp
    assert exact[1]["schedule"][0] > 1 and rows[1]["extra_steps"] == 10 - 4
    loop, peak = rows[1]["loop_s"], rows[1]["call_peak_s"]
    want = math.ceil((peak + 6 * loop) / (0.04 - 2 * loop))  # ramp_repeat 1: chunk 1 twice chunk 0
    assert rows[1]["schedule"][0] == min(10, max(exact[1]["schedule"][0], want)) > exact[1]["schedule"][0]
    row = dict(rows[1], loop_after_s=0.01, call_max_after_s=0.05)
    assert r.needed_first_chunk(row, 1) == math.ceil((0.05 + 6 * 0.01) / (0.04 - 0.02))
    causal = r.replay(trace(), horizon_s=None, ramp_repeat=1, first_chunk_margin=1.0, mode="low_latency",
                      lookahead_samples=0)
    assert [row["schedule"] for row in causal] == [row["schedule"] for row in exact]  # no ramp: exact's plans
