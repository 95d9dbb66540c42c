"""Replay a server's first-chunk decisions offline from its trace, beside what its clients heard.

    python scripts/replay_first_chunks.py trace_a.json lg_a.json [--scenario closed@256] [--horizon-s 0.5]

`Pipeline.adapter_config` sizes a stream's first chunk when its segment starts, from the engine loop's time (the
recent one and the one `LoopModel` predicts at the number of open streams) and the codec's call times. This replays
the server's `LoopModel`, call EMA and peak over the trace's steps and calls (`serve --trace-out`), calls the same
`adapter_config` at each stream's first text, and matches the streams to the load generator's (`lg_*.json`: in
arrival order, clocks aligned by the median offset). For each stream: the first chunk chosen, the loop time assumed,
the loop time the steps then took until its second chunk was due, the longest codec call then; and, with
`--horizon-s`, the first chunk the same rule gives when the number of streams is taken as the open ones plus the
arrivals of the last second scaled to the horizon (an arrival-rate term, not served). Prints a summary for the
streams that underran and the rest, with the first chunk that the loop and calls which followed would have needed
(`needed_first_chunk`, for chunk 1 as large as chunk 0 and twice as large: how session 16 chose its rule), and the
admission rule replayed at each arrival (`LoopModel.admits` at `--admit-step-ratio`: the traces hold the admitted
streams only, so it tells which of them a rule would have refused; how session 17 found v3's burst admitted on a
loop model that read ~26 ms cycles as ~12 ms steps); `--peak-half-life S` replays a call peak that forgets at
another rate (a what-if); `--mode low_latency` replays a low-latency server's plans (its idle ramp or, under load, one
window whose chunk 1 comes from the stateful decoder `extra_steps` later: the needs count those steps too; the codec's
look-ahead from `--lookahead-samples`, `--hop`); `--json` writes every row."""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import math
from types import SimpleNamespace

import numpy as np

from higgs_stream.stream.chunking import handover_steps
from higgs_stream.stream.codec_worker import CALL_PEAK_HALF_LIFE_S
from higgs_stream.stream.config import FAMILY_DEFAULT
from higgs_stream.stream.pacing import LoopModel, PacingConfig
from higgs_stream.stream.pipeline import Pipeline, frames_to_cover

FRAME_S = 0.04  # v2's frames (the Higgs codec: 25 Hz; Qwen3-TTS's 12 Hz codec: --frame-s 0.08)
HOP, LOOKAHEAD_SAMPLES = 960, 9458  # the Higgs codec (Qwen3-TTS's is causal: --lookahead-samples 0)
ARRIVAL_WINDOW_S = 1.0


def replay(events: list, horizon_s: float | None, max_first_chunk: int = FAMILY_DEFAULT["max_first_chunk"],
           ramp_repeat: int = FAMILY_DEFAULT["ramp_repeat"], frame_s: float = FRAME_S,
           first_chunk_margin: float = FAMILY_DEFAULT["first_chunk_margin"],
           admit_ratio: float | None = PacingConfig.admit_ratio,
           peak_half_life_s: float = CALL_PEAK_HALF_LIFE_S, mode: str = "exact", hop: int = HOP,
           lookahead_samples: int = LOOKAHEAD_SAMPLES) -> list[dict]:
    steps = sorted((e for e in events if e[0] == "step"), key=lambda e: e[3])
    calls = sorted((e for e in events if e[0] == "codec"), key=lambda e: e[2])
    streams = sorted((e for e in events if e[0] == "stream" and e[1] is not None), key=lambda e: e[1])
    said = [s[1] for s in streams]
    loop, call = LoopModel(), SimpleNamespace(call_s=0.0, call_peak_s=0.0, peak_at=0.0)
    geometry = SimpleNamespace(frame_seconds=frame_s, hop=hop, lookahead_samples=lookahead_samples,
                               lookahead_frames=math.ceil(lookahead_samples / hop))  # what adapter_config reads
    fake = SimpleNamespace(loop_model=loop, geometry=geometry, codec_worker=call,
                           cfg=SimpleNamespace(max_first_chunk=max_first_chunk, ramp_repeat=ramp_repeat,
                                               first_chunk_margin=first_chunk_margin), _handles=())
    fake._first_chunk = functools.partial(Pipeline._first_chunk, fake)  # what adapter_config calls on itself
    admission = PacingConfig(frame_s=frame_s, admit_ratio=admit_ratio)
    si = ci = 0
    rows = []
    for s in streams:
        t = s[1]
        while si < len(steps) and steps[si][3] <= t:  # what the engine thread had observed by then
            e = steps[si]
            loop.observe_iteration(e[4], e[3] - e[1], 2 * frame_s)  # as the pipeline observes (idle gaps aside)
            si += 1
        while ci < len(calls) and calls[ci][2] <= t:
            c = calls[ci]
            took = c[2] - c[1]
            call.call_s += 0.05 * (took - call.call_s)
            fade = 0.5 ** ((c[2] - call.peak_at) / peak_half_life_s)
            call.call_peak_s, call.peak_at = max(took, call.call_peak_s * fade), c[2]
            ci += 1
        fade = 0.5 ** ((t - call.peak_at) / peak_half_life_s) if call.peak_at else 1.0
        peak = call.call_peak_s
        call.call_peak_s = peak * fade  # as read at t (the worker stores the faded value at its next call)
        open_now = sum(1 for o in streams if o[1] <= t < o[3])
        fake._handles = range(open_now)
        plan = Pipeline.adapter_config(fake, mode)
        chosen = plan.schedule
        predicted = loop.predict(open_now)  # the step with it among the others (admission at its open())
        row = {"said_at": t, "first_audio": s[2], "open": open_now, "loop_s": max(loop.last_s, predicted or 0),
               "call_peak_s": call.call_peak_s, "schedule": list(chosen[:3]), "step_predicted_s": predicted,
               "admitted_by_rule": loop.admits(open_now - 1, admission),
               # chunk 1's steps beyond chunk 0's frames: a loaded low-latency window's hand-over to the stateful decoder
               "extra_steps": handover_steps(plan, geometry)}
        if horizon_s is not None:
            arrived = bisect.bisect_right(said, t) - bisect.bisect_right(said, t - ARRIVAL_WINDOW_S)
            expected = open_now + round(arrived / ARRIVAL_WINDOW_S * horizon_s)
            fake._handles = range(expected)
            row["schedule_with_arrivals"] = list(Pipeline.adapter_config(fake, mode).schedule[:3])
            row["open_expected"] = expected
        call.call_peak_s = peak
        if s[2] is not None:  # what followed: the loop until chunk 1 was due, the longest call meanwhile
            f = chosen[0]
            until = s[2] + f * frame_s  # chunk 0's audio played out
            w = [e[3] - e[1] for e in steps if s[2] <= e[1] < until]
            row["loop_after_s"] = float(np.mean(w)) if w else None
            row["call_max_after_s"] = max((c[2] - c[1] for c in calls if c[2] > s[2] and c[1] < until), default=0.0)
        rows.append(row)
    return rows


def needed_first_chunk(row: dict, ramp_repeat: int, frame_s: float = FRAME_S) -> int | None:
    """The frames chunk 0 needed to outlast chunk 1's steps and the longest codec call while it played, at the loop
    time and call seen then (`loop_after_s`, `call_max_after_s`): ceil((call + extra x loop) / (frame - m x loop)),
    m = 2 with ramp_repeat 1 (chunk 1 twice chunk 0), else 1, extra the row's `extra_steps`. None: no steps seen;
    math.inf: a loop too long for any chunk."""
    loop, call = row.get("loop_after_s"), row.get("call_max_after_s", 0.0)
    if not loop:
        return None
    return max(1, frames_to_cover(call, loop, frame_s, ramp_repeat, row.get("extra_steps", 0)))


def match(rows: list[dict], lg: dict, scenario: str | None) -> None:
    sc = [s for s in lg["scenarios"] if scenario is None or s["name"] == scenario]
    clients = sorted((r for s in sc for r in s["streams"] if r.get("first_audio") is not None), key=lambda r: r["sent"])
    if not clients:
        return
    # the scenario's streams are a contiguous run of the server's: align by the best median offset over the runs
    best = None
    for start in range(0, max(1, len(rows) - len(clients) + 1)):
        pairs = list(zip(rows[start:start + len(clients)], clients))
        off = np.median([c["sent"] - r["said_at"] for r, c in pairs])
        err = float(np.median([abs(c["sent"] - r["said_at"] - off) for r, c in pairs]))
        if best is None or err < best[0]:
            best = (err, start, off)
    _, start, off = best
    for r, c in zip(rows[start:start + len(clients)], clients):
        r["client_sent"] = c["sent"]
        r["underruns"] = c["underruns"]
        r["stalls_at"] = c.get("stalls_at", [])


def summary(rows: list[dict], frame_s: float = FRAME_S) -> None:
    matched = [r for r in rows if "underruns" in r]
    for name, group in (("underran", [r for r in matched if r["underruns"]]),
                        ("no underrun", [r for r in matched if not r["underruns"]])):
        if not group:
            print(f"{name}: none")
            continue
        first = np.array([r["schedule"][0] for r in group])
        line = (f"{name}: {len(group)} streams; first chunk p50 {np.median(first):.0f} (min {first.min()}, max "
                f"{first.max()}); loop assumed p50 {1e3 * np.median([r['loop_s'] for r in group]):.1f} ms, "
                f"then taken {1e3 * np.median([r['loop_after_s'] for r in group if r.get('loop_after_s')]):.1f} ms; "
                f"longest call assumed p50 {1e3 * np.median([r['call_peak_s'] for r in group]):.0f} ms, then "
                f"{1e3 * np.median([r['call_max_after_s'] for r in group]):.0f} ms")
        if "schedule_with_arrivals" in group[0]:
            alt = np.array([r["schedule_with_arrivals"][0] for r in group])
            line += f"; with arrivals: first chunk p50 {np.median(alt):.0f} (min {alt.min()}), larger for {(alt > first).sum()}"
        print(line)
        refused = sum(not r["admitted_by_rule"] for r in group)
        print(f"  admission: predicted step p50 {1e3 * np.median([r['step_predicted_s'] or 0 for r in group]):.1f} ms; "
              f"the step-ratio rule would refuse {refused} of them")
        cap = max(r["schedule"][0] for r in group)
        for m in (1, 2):  # chunk 1 twice chunk 0, or as large
            pairs = [(r["schedule"][0], n) for r in group if (n := needed_first_chunk(r, m, frame_s)) is not None]
            if pairs:
                need = np.array([n for _, n in pairs], dtype=float)
                p50, p90 = np.percentile(need, [50, 90], method="higher")  # no interpolation: needs may be inf
                print(f"  ramp_repeat {m}: first chunk needed then p50 {p50:.0f}, p90 {p90:.0f}; more than {cap} for {int((need > cap).sum())}; the replayed "
                      f"chunk short of it for {sum(f < n for f, n in pairs)}")
        stall_frames = [round(a / frame_s) for r in group for a in r.get("stalls_at", [])[:1]]
        if stall_frames:
            print(f"  first stall at the end of frame (client): p50 {np.median(stall_frames):.0f}; replayed first "
                  f"chunk equal to it for {sum(r['schedule'][0] == f for r, f in zip(group, stall_frames))} of "
                  f"{len(stall_frames)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("loadgen", nargs="?")
    ap.add_argument("--scenario", default=None)
    ap.add_argument("--horizon-s", type=float, default=None)
    ap.add_argument("--max-first-chunk", type=int, default=FAMILY_DEFAULT["max_first_chunk"])
    ap.add_argument("--ramp-repeat", type=int, default=FAMILY_DEFAULT["ramp_repeat"],
                    help="the server's setting (default: the Higgs families'; Qwen3-TTS and traces from before "
                         "session 16: 1)")
    ap.add_argument("--first-chunk-margin", type=float, default=FAMILY_DEFAULT["first_chunk_margin"],
                    help="the server's setting (default: the Higgs families'; Qwen3-TTS and traces from before "
                         "session 16: 1)")
    ap.add_argument("--frame-s", type=float, default=FRAME_S, help="seconds of audio per codec frame")
    ap.add_argument("--admit-step-ratio", type=float, default=PacingConfig.admit_ratio,
                    help="the admission rule replayed at each arrival (the server's --admit-step-ratio)")
    ap.add_argument("--peak-half-life", type=float, default=CALL_PEAK_HALF_LIFE_S, metavar="S",
                    help="how fast the replayed codec call peak forgets a long call (the server's CALL_PEAK_HALF_LIFE_S "
                         "by default; a what-if: the first chunks a slower-forgetting peak would have chosen)")
    ap.add_argument("--mode", choices=("exact", "low_latency"), default="exact", help="the streams' mode")
    ap.add_argument("--hop", type=int, default=HOP, help="samples a codec frame (low-latency plans)")
    ap.add_argument("--lookahead-samples", type=int, default=LOOKAHEAD_SAMPLES,
                    help="the codec's look-ahead (low-latency plans; 0: a causal codec, whose plans are exact's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = replay(json.load(open(args.trace))["events"], args.horizon_s, args.max_first_chunk, args.ramp_repeat,
                  args.frame_s, args.first_chunk_margin, args.admit_step_ratio, args.peak_half_life, args.mode,
                  args.hop, args.lookahead_samples)
    if args.loadgen:
        match(rows, json.load(open(args.loadgen)), args.scenario)
    summary(rows, args.frame_s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o)


if __name__ == "__main__":
    main()
