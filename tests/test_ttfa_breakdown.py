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
