"""One scenario across several load-generator runs (an A/B with repeats at one load), as bars per run.

    python scripts/plot_runs.py --scenario closed@256 --plot out.png default=a.json,a2.json new=rr.json,rr2.json

Each `LABEL=FILE,FILE,...` is one configuration; each file holds one run or several (`lg_*.json` of
`higgs_stream.loadgen`; a scenario listed more than once, e.g. `--closed 128,128,128`, runs again on the same server:
each repeat is a run here). Draws the streams that underran and the TTFA p50 / p95 of every run, grouped by
configuration, and prints the same table, then each configuration's median p95 and, against the first
configuration, the chance that its runs' p95s rank this low or lower by luck alone (an exact one-sided rank-sum test:
every way of dealing the pooled runs into two groups of these sizes equally likely; runs are not independent draws
when machines differ, so read it as a guide, not a proof). (`loadgen --plot-from` draws curves over the load, which
need several loads.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics


def rows(groups: list[tuple[str, list[str]]], scenario: str) -> list[dict]:
    out = []
    for label, files in groups:
        runs = [s for f in files for s in json.load(open(f))["scenarios"] if s["name"] == scenario]
        if not runs:
            raise SystemExit(f"{label}: no {scenario} run in {', '.join(files)}")
        for i, s in enumerate(runs):
            out.append({"config": label, "run": i + 1, "served": s["completed"], "busy": s["busy"],
                        "underran": s["streams_with_underrun"], "p50": s["ttfa_ms"]["p50"], "p95": s["ttfa_ms"]["p95"]})
    return out


def rank_sum_p(low: list[float], high: list[float]) -> float:
    """P(a random split of the pooled values gives the first group a rank sum <= that of `low`): small when `low`'s
    values rank below `high`'s (ties share their mean rank). Exact, by enumerating the splits (at most 24 values)."""
    pooled = sorted(low + high)
    if len(pooled) > 24:
        raise ValueError("rank_sum_p enumerates every split: at most 24 values")
    rank = {}
    for v in set(pooled):  # mean of the 1-based positions a tied value holds
        at = [i + 1 for i, w in enumerate(pooled) if w == v]
        rank[v] = sum(at) / len(at)
    ranks = [rank[v] for v in pooled]
    mine = sum(rank[v] for v in low)
    splits = list(itertools.combinations(ranks, len(low)))
    return sum(1 for c in splits if sum(c) <= mine + 1e-9) / len(splits)


def summary(table: list[dict]) -> list[dict]:
    """Per configuration, in order: runs, median p95, and (all but the first) rank_sum_p of its p95s vs the first's."""
    by: dict[str, list[float]] = {}
    for r in table:
        by.setdefault(r["config"], []).append(r["p95"])
    first = next(iter(by.values()))
    return [{"config": c, "runs": len(v), "p95_median": statistics.median(v),
             "p_lower": None if i == 0 else rank_sum_p(v, first)} for i, (c, v) in enumerate(by.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("groups", nargs="+", metavar="LABEL=FILE[,FILE...]")
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--plot", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    groups = [(g.split("=", 1)[0], g.split("=", 1)[1].split(",")) for g in args.groups]
    table = rows(groups, args.scenario)
    print(f"{'config':<12} run served busy underran  TTFA p50   p95")
    for r in table:
        print(f"{r['config']:<12} {r['run']:>3} {r['served']:>6} {r['busy']:>4} {r['underran']:>8} {r['p50']:>9.0f} {r['p95']:>5.0f}")
    for r in summary(table):
        vs = "" if r["p_lower"] is None else f"; p95s this low by chance vs {groups[0][0]}: {r['p_lower']:.3f}"
        print(f"{r['config']:<12} {r['runs']} runs, median p95 {r['p95_median']:.0f}{vs}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{r['config']}\n#{r['run']}" for r in table]
    colors = {label: f"C{i}" for i, (label, _) in enumerate(groups)}
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8, 0.6 * len(table) + 4), 4))
    a.bar(names, [r["underran"] for r in table], color=[colors[r["config"]] for r in table])
    a.set_ylabel("streams that underran")
    a.set_ylim(0, max(1, max(r["underran"] for r in table) * 1.1))  # a run of zeros: an axis from 0, not around it
    a.set_title(f"{args.scenario}: streams with a gap")
    x = range(len(table))
    b.bar([i - 0.2 for i in x], [r["p50"] for r in table], 0.4, label="p50", color="0.7")
    b.bar([i + 0.2 for i in x], [r["p95"] for r in table], 0.4, label="p95", color=[colors[r["config"]] for r in table])
    b.set_xticks(list(x), names)
    b.set_ylabel("TTFA (ms)")
    b.set_title(f"{args.scenario}: time to first audio")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7, labelrotation=60)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
