"""scripts/plot_runs.py: runs from files and repeats, the per-configuration summary and its rank-sum test."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("plot_runs", Path(__file__).parents[1] / "scripts" / "plot_runs.py")
plot_runs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_runs)


def _result(path: Path, *p95s: float, name: str = "closed@128") -> str:
    scenarios = [{"name": name, "completed": 100 + i, "busy": 0, "streams_with_underrun": i,
                  "ttfa_ms": {"p50": p / 2, "p95": p}} for i, p in enumerate(p95s)]
    scenarios.append({"name": "open@20/s", "completed": 1, "busy": 0, "streams_with_underrun": 0,
                      "ttfa_ms": {"p50": 1.0, "p95": 2.0}})
    path.write_text(json.dumps({"scenarios": scenarios}))
    return str(path)


def test_every_repeat_of_the_scenario_is_a_run(tmp_path):
    a = _result(tmp_path / "a.json", 306, 273)  # two repeats on one server
    b = _result(tmp_path / "b.json", 378)
    c = _result(tmp_path / "c.json", 268)
    table = plot_runs.rows([("64", [a, b]), ("32", [c])], "closed@128")
    assert [(r["config"], r["run"], r["p95"], r["underran"]) for r in table] == [
        ("64", 1, 306, 0), ("64", 2, 273, 1), ("64", 3, 378, 0), ("32", 1, 268, 0)]
    with pytest.raises(SystemExit, match="no closed@256 run"):
        plot_runs.rows([("64", [a])], "closed@256")


def test_rank_sum_p_counts_the_splits_that_rank_as_low():
    base = [306, 273, 378, 311, 302, 283]
    # session 27's v2 runs: 32 ranks 1, 2, 4 of 9; of the C(9, 3) = 84 splits, {1, 2, 3} and {1, 2, 4} rank as low
    assert plot_runs.rank_sum_p([268, 218, 280], base) == pytest.approx(2 / 84)
    assert plot_runs.rank_sum_p([1, 2], [3, 4]) == pytest.approx(1 / 6)  # the lowest of C(4, 2) = 6 splits
    assert plot_runs.rank_sum_p([3, 4], [1, 2]) == 1.0  # the highest: every split ranks at most as high
    assert plot_runs.rank_sum_p([5, 5], [5, 5]) == 1.0  # all tied: every split has the same rank sum
    with pytest.raises(ValueError, match="at most 24"):
        plot_runs.rank_sum_p(list(range(13)), list(range(13)))


def test_summary_compares_each_configuration_with_the_first():
    table = [{"config": "64", "p95": p} for p in (306, 273, 378, 311, 302, 283)]
    table += [{"config": "32", "p95": p} for p in (268, 218, 280)]
    out = plot_runs.summary(table)
    assert out[0] == {"config": "64", "runs": 6, "p95_median": 304.0, "p_lower": None}
    assert out[1]["runs"] == 3 and out[1]["p95_median"] == 268 and out[1]["p_lower"] == pytest.approx(2 / 84)
