"""scripts/ab_rounds.py: an A/B's alternating rounds read back per tree and batch, medians, ratio, and whether the
trees' ranges are apart (the difference told from the spread between processes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("ab_rounds", Path(__file__).parents[1] / "scripts" / "ab_rounds.py")
ab_rounds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_rounds)


def write(out: Path, name: str, ms: dict[int, float]) -> None:
    rows = [{"batch": b, "bucket": b, "replay_ms": v, "step_ms": v + 0.02} for b, v in ms.items()]
    (out / f"{name}.json").write_text(json.dumps({"card": "test", "decode": rows}))


def test_rounds_give_medians_ratios_and_whether_the_trees_are_apart(tmp_path, capsys):
    # batch 1: this tree faster in every run (apart); batch 4: the spread covers the difference (not apart)
    write(tmp_path, "bench_r1", {1: 2.40, 4: 2.60})
    write(tmp_path, "baseline_r1", {1: 2.50, 4: 2.55})
    write(tmp_path, "bench_r2", {1: 2.44, 4: 2.50})
    write(tmp_path, "baseline_r2", {1: 2.52, 4: 2.58})
    write(tmp_path, "bench_r10", {1: 2.42})  # rounds sort by number, not as text; batch 4 missing from this run
    (tmp_path / "baseline_r3.json").write_text(json.dumps({"card": "test"}))  # a run that crashed: no rows
    runs = ab_rounds.load_runs(tmp_path)
    assert runs["bench"] == [{1: 2.40, 4: 2.60}, {1: 2.44, 4: 2.50}, {1: 2.42}] and len(runs["baseline"]) == 2
    one, four = ab_rounds.summarise(runs)
    assert one["this_ms"] == [2.40, 2.44, 2.42] and one["this_median"] == 2.42 and one["base_median"] == 2.51
    assert one["ratio"] == pytest.approx(2.42 / 2.51) and one["separated"] is True
    assert four["this_ms"] == [2.60, 2.50] and four["this_median"] == pytest.approx(2.55)
    assert four["base_median"] == pytest.approx(2.565) and four["separated"] is False
    assert ab_rounds.main([str(tmp_path), "--json", str(tmp_path / "s.json")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "replay_ms:" and printed[4] == "step_ms:"
    assert printed[2].split() == ["1", "2.400", "2.440", "2.420", "2.500", "2.520", "0.964", "yes"]
    assert printed[6].split()[1:4] == ["2.420", "2.460", "2.440"]  # the step times (replay + 0.02 here)
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["replay_ms"][1]["separated"] is False and saved["step_ms"][0]["this_median"] == pytest.approx(2.44)


def test_this_tree_alone_has_no_ratio(tmp_path):
    write(tmp_path, "bench_r1", {16: 3.0})
    (row,) = ab_rounds.summarise(ab_rounds.load_runs(tmp_path))
    assert row["this_median"] == 3.0 and row["base_ms"] == [] and row["ratio"] is None and row["separated"] is None
    assert "-" in ab_rounds.table([row]).splitlines()[1].split()


def test_one_run_a_tree_tells_no_spread(tmp_path):
    """A single round gives the ratio but not whether the trees are apart: one run has no spread to compare with."""
    write(tmp_path, "bench_r1", {1: 2.0})
    write(tmp_path, "baseline_r1", {1: 2.5})
    (row,) = ab_rounds.summarise(ab_rounds.load_runs(tmp_path))
    assert row["ratio"] == pytest.approx(0.8) and row["separated"] is None
    assert ab_rounds.table([row]).splitlines()[1].split()[-1] == "-"
