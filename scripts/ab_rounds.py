"""Summarise an A/B of decode benchmarks run in alternating rounds (`ROUNDS=N bash scripts/gpu_bench_ab.sh`).

Each run is one process, and processes of the same code on the same card can differ by several per cent (H200,
session 24: a Qwen3-TTS 1.7B bucket's isolated replay moved 6.48 -> 6.14 ms between two processes of one tree, its
back-to-back step 6.17 -> 6.15). Alternating the trees (this, base, this, base, ...) lets that offset show as the
spread within a tree. For both of the benchmark's times, `replay_ms` (one graph replay between two events, the device
idle before it: the graph's launch latency included) and `step_ms` (steps issued back to back, host staging included,
so the launch overlaps the previous step), and for each batch, this prints every run's time, each tree's median, the
ratio of the medians, and whether the two trees' ranges are apart (if not, the difference is not told apart from the
spread).

Usage: python scripts/ab_rounds.py OUT_DIR [--json SUMMARY.json]   (reads OUT_DIR/{bench,baseline}_r*.json)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

TREES = ("bench", "baseline")  # the files' prefixes: this tree, the baseline tree
METRICS = ("replay_ms", "step_ms")
Runs = dict[str, list[dict[int, float]]]  # {tree: [one dict per round: batch -> ms]}, rounds in order


def load_runs(out_dir: Path, metric: str = "replay_ms") -> Runs:
    """Every round's `metric` by tree and batch; a run that wrote no decode rows (it crashed or ran out of time) is
    left out."""
    runs: Runs = {t: [] for t in TREES}
    for tree in TREES:
        for path in sorted(out_dir.glob(f"{tree}_r*.json"), key=lambda p: int(p.stem.rsplit("_r", 1)[1])):
            rows = json.loads(path.read_text()).get("decode") or []
            if rows:
                runs[tree].append({int(r["batch"]): float(r[metric]) for r in rows})
    return runs


def summarise(runs: Runs) -> list[dict[str, Any]]:
    """One row per batch this tree measured: each run's ms and the median; where the baseline measured it too, its
    runs and median, this / baseline, and `separated` (the trees' ranges do not overlap; None unless each tree ran
    at least twice: one run has no spread to tell the difference from); else those are None."""
    out = []
    for b in sorted(set().union(*runs["bench"])):
        this = [r[b] for r in runs["bench"] if b in r]
        base = [r[b] for r in runs["baseline"] if b in r]
        row = {"batch": b, "this_ms": this, "base_ms": base, "this_median": statistics.median(this),
               "base_median": None, "ratio": None, "separated": None}
        if base:
            row["base_median"] = statistics.median(base)
            row["ratio"] = row["this_median"] / row["base_median"]
            if len(this) >= 2 and len(base) >= 2:
                row["separated"] = max(this) < min(base) or max(base) < min(this)
        out.append(row)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'batch':>5}  {'this (runs)':<28} {'base (runs)':<28} {'this/base':>9}  apart"]
    for r in rows:
        runs = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        apart = "-" if r["separated"] is None else ("yes" if r["separated"] else "no")
        lines.append(f"{r['batch']:>5}  {runs(r['this_ms']):<28} {runs(r['base_ms']):<28} {ratio:>9}  {apart}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    summary = {}
    for metric in METRICS:
        summary[metric] = summarise(load_runs(args.out_dir, metric))
        print(f"{metric}:\n{table(summary[metric])}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
