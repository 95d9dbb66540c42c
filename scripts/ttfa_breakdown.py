"""Where each stream's time to first audio went, from `serve --trace-out FILE`: the engine steps and
codec calls between its first text and its first audio, and the time covered by neither.

    python scripts/ttfa_breakdown.py trace.json [--json out.json]

Meaningful for streams that ran alone or nearly (open loop at a low rate): under load every stream
shares every step. Prints the median over streams of each part, in ms."""

from __future__ import annotations

import argparse
import json

import numpy as np


def breakdown(events: list[list]) -> list[dict]:
    steps = [e for e in events if e[0] == "step"]
    calls = [e for e in events if e[0] == "codec"]
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
            "ttfa_ms": 1e3 * (first - said),
            "steps": len(own_steps),
            "prefill_steps": sum(1 for s in own_steps if len(s) > 6 and s[6] > 0),
            "step_ms": 1e3 * sum(inside(s[1], s[3]) for s in own_steps),
            "prefill_step_ms": 1e3 * sum(inside(s[1], s[3]) for s in own_steps if len(s) > 6 and s[6] > 0),
            "codec_calls": len(own_calls),
            "codec_ms": 1e3 * sum(inside(c[1], c[2]) for c in own_calls),
            "idle_ms": 1e3 * (first - said - covered),
            "before_first_step_ms": 1e3 * ((own_steps[0][1] - said) if own_steps else first - said),
            "after_last_codec_ms": 1e3 * ((first - own_calls[-1][2]) if own_calls else 0.0)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--json", default=None, help="also write the per-stream rows and medians here")
    ap.add_argument("--alone", action="store_true",
                    help="only streams no other stream overlapped from first text to first audio")
    args = ap.parse_args()
    with open(args.trace) as f:
        rows = [r for r in breakdown(json.load(f)["events"]) if r["alone"] or not args.alone]
    if not rows:
        raise SystemExit("no stream with first audio in the trace")
    keys = [k for k in rows[0] if k != "alone"]
    med = {k: float(np.median([r[k] for r in rows])) for k in keys}
    print(f"{len(rows)} streams; medians: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median": med, "streams": rows}, f, indent=1)


if __name__ == "__main__":
    main()
