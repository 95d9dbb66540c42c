"""Where each stream's time to first audio went, from `serve --trace-out FILE`: the engine steps and
codec calls between its first text and its first audio, and the time covered by neither.

    python scripts/ttfa_breakdown.py trace.json [--split-gap 1.5] [--json out.json]
    python scripts/ttfa_breakdown.py trace.json --beside-calls 100,140   # decode steps of 100-140 rows by codec call

Meaningful for streams that ran alone or nearly (open loop at a low rate): under load every stream
shares every step. Prints the median over streams of each part, in ms."""

from __future__ import annotations

import argparse
import json
import warnings

import numpy as np

from higgs_stream.bench.trace import steps_beside_calls


def breakdown(events: list[list]) -> list[dict]:
    steps = [e for e in events if e[0] == "step"]
    calls = sorted((e for e in events if e[0] == "codec"), key=lambda e: e[2])
    frame0: dict[float, float] = {}  # a context's first text -> its first segment's first frame routed
    for e in events:
        if e[0] == "frame0":
            frame0.setdefault(e[2], e[1])  # later segments of the context share its first text
    ends = np.array([c[2] for c in calls])
    rows = []
    streams = sorted((e for e in events if e[0] == "stream" and e[1] is not None), key=lambda e: e[1])
    for _, said, first, _end, _samples in streams:
        if first is None:
            continue
        def inside(t0: float, t1: float, said: float = said, first: float = first) -> float:
            return max(0.0, min(t1, first) - max(t0, said))

        own_steps = [s for s in steps if inside(s[1], s[3]) > 0]
        own_calls = [c for c in calls if inside(c[1], c[2]) > 0]
        busy = sorted([(max(s[1], said), min(s[3], first)) for s in own_steps]
                      + [(max(c[1], said), min(c[2], first)) for c in own_calls])
        covered, reach = 0.0, said
        for t0, t1 in busy:  # union of busy intervals (steps and codec calls overlap on two threads)
            if t1 > reach:
                covered += t1 - max(t0, reach)
                reach = t1
        others = [o for o in streams if o[1] != said and o[1] < first and o[3] > said]
        rows.append({
            "alone": not others,
            "said_s": said,  # the first text's time (the trace's monotonic clock): rows are in this order
            "ttfa_ms": 1e3 * (first - said),
            "steps": len(own_steps),
            "prefill_steps": sum(1 for s in own_steps if len(s) > 6 and s[6] > 0),
            "step_ms": 1e3 * sum(inside(s[1], s[3]) for s in own_steps),
            "prefill_step_ms": 1e3 * sum(inside(s[1], s[3]) for s in own_steps if len(s) > 6 and s[6] > 0),
            "codec_calls": len(own_calls),
            "codec_ms": 1e3 * sum(inside(c[1], c[2]) for c in own_calls),
            "idle_ms": 1e3 * (first - said - covered),
            "before_first_step_ms": 1e3 * ((own_steps[0][1] - said) if own_steps else first - said),
            "after_last_codec_ms": 1e3 * ((first - own_calls[-1][2]) if own_calls else 0.0),
            # with frame0 events (servers since 2026-11-27): first text -> first frame -> the first chunk's
            # codec call (the last call that ended before the first audio) starts -> first audio
            "to_first_frame_ms": 1e3 * (frame0[said] - said) if said in frame0 else float("nan"),
            "frame_to_call_ms": _frame_to_call(frame0.get(said), calls, ends, first),
            "late_steps": sum(1 for s in own_steps if len(s) > 7 and s[7] > 0),
            "sync_steps": sum(1 for s in own_steps if len(s) > 8 and s[8]),
            # servers since session 20: the engine's waits for room in the codec's queue (at each step's end)
            "queue_wait_ms": 1e3 * sum(_queue_wait_inside(s, said, first) for s in own_steps if len(s) > 9)})
    return rows


def _queue_wait_inside(step: list, said: float, first: float) -> float:
    """The part of a step's wait for the codec queue (its last `step[9]` seconds) between `said` and `first`."""
    return max(0.0, min(step[3], first) - max(step[3] - step[9], said))


def _frame_to_call(frame: float | None, calls: list, ends: np.ndarray, first: float) -> float:
    i = int(np.searchsorted(ends, first, side="right")) - 1
    if frame is None or i < 0:
        return float("nan")
    return 1e3 * (calls[i][1] - frame)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--json", default=None, help="also write the per-stream rows and medians here")
    ap.add_argument("--alone", action="store_true",
                    help="only streams no other stream overlapped from first text to first audio")
    ap.add_argument("--split-gap", type=float, default=None, metavar="S",
                    help="a breakdown per group of streams, split where no stream arrived for S seconds (the load "
                         "generator's scenarios, one after the other)")
    ap.add_argument("--beside-calls", default=None, metavar="LO,HI",
                    help="instead: decode-only steps of LO..HI rows grouped by the largest codec call beside them "
                         "(higgs_stream.bench.steps_beside_calls: what GPU contention costs the talker)")
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["events"]
    if args.beside_calls:
        lo, hi = (int(x) for x in args.beside_calls.split(","))
        for g in steps_beside_calls(events, rows=(lo, hi)):
            print(f"{g['beside']:>16}: {g['steps']:5d} steps, wall p50 / p95 {g['step_ms_p50']:.1f} / {g['step_ms_p95']:.1f} ms, "
                  f"device wait p50 / p95 {g['wait_ms_p50']:.1f} / {g['wait_ms_p95']:.1f} ms")
        return
    rows = [r for r in breakdown(events) if r["alone"] or not args.alone]
    if not rows:
        raise SystemExit("no stream with first audio in the trace")
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # all-NaN columns of traces without frame0 events
    groups = split_at_gaps(rows, args.split_gap) if args.split_gap else [rows]
    out = []
    for group in groups:
        med, p95 = summary(group)
        if len(groups) > 1:
            print(f"-- {len(group)} streams arriving over {group[-1]['said_s'] - group[0]['said_s']:.1f} s")
        print(f"{len(group)} streams; medians: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
        print("p95: " + ", ".join(f"{k} {v:.1f}" for k, v in p95.items()))
        out.append({"median": med, "p95": p95, "streams": group})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out[0] if len(out) == 1 else {"groups": out}, f, indent=1)


def split_at_gaps(rows: list[dict], gap_s: float) -> list[list[dict]]:
    """Rows (in arrival order) in groups split where the next stream's first text came more than gap_s later."""
    groups = [[rows[0]]]
    for prev, row in zip(rows, rows[1:]):
        if row["said_s"] - prev["said_s"] > gap_s:
            groups.append([])
        groups[-1].append(row)
    return groups


def summary(rows: list[dict]) -> tuple[dict, dict]:
    """Median and p95 over the rows of every part (NaN-aware)."""
    keys = [k for k in rows[0] if k not in ("alone", "said_s")]
    med = {k: float(np.nanmedian([r[k] for r in rows])) for k in keys}
    p95 = {k: float(np.nanpercentile([r[k] for r in rows], 95)) for k in keys}
    return med, p95


if __name__ == "__main__":
    main()
