"""scripts/ttfa_breakdown.py's per-scenario split: streams grouped at gaps in their arrivals, a summary per group."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("ttfa_breakdown", Path(__file__).parents[1] / "scripts" / "ttfa_breakdown.py")
ttfa_breakdown = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ttfa_breakdown)


def test_groups_split_at_arrival_gaps_and_summaries_leave_out_the_bookkeeping():
    rows = [{"alone": False, "said_s": t, "ttfa_ms": ms} for t, ms in ((0.0, 10), (0.5, 30), (3.0, 50), (3.2, 70),
                                                                       (10.0, 90))]
    groups = ttfa_breakdown.split_at_gaps(rows, 1.5)
    assert [[r["said_s"] for r in g] for g in groups] == [[0.0, 0.5], [3.0, 3.2], [10.0]]
    med, p95 = ttfa_breakdown.summary(groups[1])
    assert med == {"ttfa_ms": 60.0} and p95 == {"ttfa_ms": pytest.approx(69.0)}
    assert ttfa_breakdown.split_at_gaps(rows, 100.0) == [rows]


def test_a_streams_wait_for_the_codec_queue_counts_only_inside_its_time_to_first_audio():
    """Steps' 10th field (servers since session 20): the engine's wait for room in the codec's queue, the last part of
    the step; a stream is charged the part between its first text and its first audio."""
    events = [["stream", 1.000, 1.100, 2.0, 24000],
              ["step", 0.990, 1.000, 1.020, 1, 0.0, 1, 0, False, 0.015],  # waits 1.005-1.020: 15 ms inside
              ["step", 1.020, 1.030, 1.090, 1, 0.0, 0, 0, False, 0.050],  # 1.040-1.090: 50 ms inside
              ["step", 1.090, 1.095, 1.120, 1, 0.0, 0, 0, False, 0.020],  # 1.100-1.120: after the first audio
              ["codec", 1.095, 1.099, 1, 11, 1, True, 0, 0.001]]
    (row,) = ttfa_breakdown.breakdown(events)
    assert row["queue_wait_ms"] == pytest.approx(65.0)
    older = [e[:9] if e[0] == "step" else e for e in events]
    assert ttfa_breakdown.breakdown(older)[0]["queue_wait_ms"] == 0.0
