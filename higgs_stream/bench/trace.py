"""Where a streaming run's time went, from its trace (`stream_bench(trace=True)`, or a server's
`serve --trace-out FILE`: its "events"): engine steps, codec calls, the talker's decode replays beside
a codec call, and garbage collections (every thread waits for each)."""

from __future__ import annotations

import numpy as np


def trace_summary(trace: list[tuple], wall_s: float) -> dict:
    """Where an in-process run's time went: engine-loop iterations (engine.step split into host work and
    device waits, then routing) and codec calls, and how much longer a step takes while a codec call runs."""
    steps = [t for t in trace if t[0] == "step"]
    calls = sorted((t for t in trace if t[0] == "codec"), key=lambda t: t[1])
    replays = [t for t in trace if t[0] == "replay"]  # ("replay", host launch time, rows, device seconds)
    if not steps:
        return {}
    arr = lambda xs: np.asarray(xs, dtype=np.float64) * 1e3
    wall, engine, wait, route = (arr([t[3] - t[1] for t in steps]), arr([t[2] - t[1] for t in steps]),
                                 arr([t[5] for t in steps]), arr([t[3] - t[2] for t in steps]))
    prefill = np.array([len(t) > 6 and t[6] > 0 for t in steps])
    overlapped = np.array([bool(near) for near in calls_beside(steps, calls)], dtype=bool)
    dur = arr([c[2] - c[1] for c in calls]) if calls else np.zeros(1)
    pct = lambda a, q: float(np.percentile(a, q)) if a.size else float("nan")
    return {"steps": len(steps), "step_ms_p50": pct(wall, 50), "step_ms_p95": pct(wall, 95),
            "engine_host_ms": float((engine - wait).mean()), "engine_wait_ms": float(wait.mean()),
            "route_ms": float(route.mean()),
            "step_ms_with_prefill": _mean(wall[prefill]), "step_ms_without_prefill": _mean(wall[~prefill]),
            "share_of_steps_with_prefill": float(prefill.mean()),
            "late_launches": int(sum(t[7] for t in steps if len(t) > 7)),  # prompt launches beside a step in flight
            "sync_steps": int(sum(1 for t in steps if len(t) > 8 and t[8])),
            **_queue_wait_summary(steps),
            "step_ms_with_codec": float(wall[overlapped].mean()) if overlapped.any() else None,
            "step_ms_without_codec": float(wall[~overlapped].mean()) if (~overlapped).any() else None,
            "share_of_steps_with_codec": float(overlapped.mean()),
            "codec_calls": len(calls), "codec_ms_p50": pct(dur, 50), "codec_ms_p95": pct(dur, 95),
            "codec_jobs_mean": float(np.mean([c[3] for c in calls])) if calls else 0.0,
            "codec_frames_mean": float(np.mean([c[4] for c in calls])) if calls else 0.0,
            "codec_steps": (calls[-1][5] - calls[0][5] + 1) if calls else 0,
            "codec_busy_share": float(dur.sum() / 1e3 / wall_s) if calls else 0.0,
            **_backlog_summary(calls),
            **_overdue_summary(calls),
            **_replay_summary(replays, calls),
            **_gc_summary([t for t in trace if t[0] == "gc"], next((t[1] for t in trace if t[0] == "serving"), None)),
            **_build_summary([t for t in trace if t[0] == "build"])}


def calls_beside(steps: list[tuple], calls: list[tuple]) -> list[list[tuple]]:
    """For each step, the codec calls that ran beside it: begun before the step ended, not ended before it began.
    Steps in time order, calls sorted by start and run one after another (one codec thread): one pass."""
    out, j = [], 0
    for t in steps:
        while j < len(calls) and calls[j][2] < t[1]:
            j += 1
        k = j
        while k < len(calls) and calls[k][1] < t[3]:
            k += 1
        out.append(calls[j:k])
    return out


def _queue_wait_summary(steps: list[tuple]) -> dict:
    """The engine thread's waits for room in the codec's queue (the step trace's 10th field, servers since session 20:
    `codec_queue_rounds` back-pressure): their total, the longest, and how many steps waited over 5 ms."""
    waits = np.array([t[9] for t in steps if len(t) > 9], dtype=np.float64)
    if not waits.size:
        return {}
    return {"queue_wait_s": float(waits.sum()), "queue_wait_ms_max": float(waits.max() * 1e3),
            "queue_waits_over_5ms": int((waits > 0.005).sum())}


def _backlog_summary(calls: list[tuple]) -> dict:
    """Frames the codec still held after each call (the trace's 8th field, servers since session 19): median, p95
    and the largest; nothing for older traces."""
    held = np.array([c[7] for c in calls if len(c) > 7], dtype=np.float64)
    if not held.size:
        return {}
    return {"codec_held_frames_p50": float(np.percentile(held, 50)), "codec_held_frames_p95": float(np.percentile(held, 95)),
            "codec_held_frames_max": int(held.max())}


def _overdue_summary(calls: list[tuple]) -> dict:
    """Codec calls that held an overdue job (first chunks, dry listeners: the trace's 7th field): how
    many, and their median wall time (what `--codec-overdue-first` shortens, if anything); with the 9th field
    (servers since session 20), how long each one's most overdue job had waited past its deadline when the call
    began, p50 / p95 / max: for a first chunk (due when it is made) its wait for the codec thread."""
    overdue = [c for c in calls if len(c) > 6 and c[6]]
    out = {"codec_overdue_calls": len(overdue),
           "codec_overdue_ms_p50": float(np.median([1e3 * (c[2] - c[1]) for c in overdue])) if overdue else None}
    late = np.array([c[8] for c in overdue if len(c) > 8], dtype=np.float64) * 1e3
    if late.size:
        out |= {"codec_overdue_late_ms_p50": float(np.percentile(late, 50)),
                "codec_overdue_late_ms_p95": float(np.percentile(late, 95)),
                "codec_overdue_late_ms_max": float(late.max())}
    return out


def _build_summary(builds: list) -> dict:
    """("build", t0, t1, kind, name) events (stream/kernel_builds.py; the pipeline traces those after start-up): how
    many kernels serving built, their seconds in all and the longest."""
    seconds = [b[2] - b[1] for b in builds]
    return {"builds": len(builds), "build_ms_sum": sum(seconds) * 1e3, "build_ms_max": max(seconds, default=0.0) * 1e3}


def _gc_summary(gcs: list, serving: float | None = None) -> dict:
    """("gc", t0, t1, generation) events: how many, how many full (generation 2), the longest of each;
    with a ("serving", t) event (the server's start-up done), collections that began before it (start-up's
    own gc.collect() before gc.freeze(), no listener yet) are left out and reported apart."""
    startup = [g for g in gcs if serving is not None and g[1] < serving]
    gcs = [g for g in gcs if serving is None or g[1] >= serving]
    full = [g[2] - g[1] for g in gcs if g[3] == 2]
    return {"gc_collections": len(gcs), "gc_full": len(full),
            "gc_ms_max": max((g[2] - g[1] for g in gcs), default=0.0) * 1e3, "gc_full_ms_max": max(full, default=0.0) * 1e3,
            "gc_startup_ms_max": max((g[2] - g[1] for g in startup), default=0.0) * 1e3}


def _mean(a: np.ndarray) -> float | None:
    return float(a.mean()) if a.size else None


def _replay_summary(replays: list[tuple], calls: list[tuple]) -> dict:
    """Device time of the talker's decode replays, apart and beside a codec call (GPU contention)."""
    if not replays:
        return {}
    beside = np.array([any(c[1] <= r[1] <= c[2] for c in calls) for r in replays])
    ms = np.array([r[3] for r in replays]) * 1e3
    rows = np.array([r[2] for r in replays])
    return {"replay_ms_mean": float(ms.mean()), "replay_rows_mean": float(rows.mean()),
            "replay_ms_beside_codec": float(ms[beside].mean()) if beside.any() else None,
            "replay_ms_alone": float(ms[~beside].mean()) if (~beside).any() else None}


def steps_beside_calls(trace: list, rows: tuple[int, int] = (0, 1 << 30),
                       frame_bins: tuple[int, ...] = (400, 1200)) -> list[dict]:
    """Decode-only engine steps of `rows` (lo, hi inclusive) rows, grouped by the largest codec call (in frames)
    that overlapped them: none, below each of `frame_bins`, at or above the last. Per group: how many steps, their
    wall time and device wait, p50 and p95 (ms). What GPU contention costs the talker beside the codec (docs/PERF.md,
    session 19)."""
    steps = [t for t in trace if t[0] == "step" and rows[0] <= t[4] <= rows[1] and not (len(t) > 6 and t[6])]
    calls = sorted((t for t in trace if t[0] == "codec"), key=lambda t: t[1])
    edges = [0, *frame_bins]
    names = ["none"] + [f"{lo}-{hi - 1} frames" for lo, hi in zip(edges, edges[1:])] + [f">={edges[-1]} frames"]
    groups: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for s, near in zip(steps, calls_beside(steps, calls)):
        frames = max((c[4] for c in near), default=None)
        name = names[0] if frames is None else names[1 + int(np.searchsorted(frame_bins, frames, side="right"))]
        groups[name].append(((s[3] - s[1]) * 1e3, s[5] * 1e3))
    out = []
    for name, xs in groups.items():
        if xs:
            a = np.asarray(xs)
            out.append({"beside": name, "steps": len(a),
                        "step_ms_p50": float(np.percentile(a[:, 0], 50)), "step_ms_p95": float(np.percentile(a[:, 0], 95)),
                        "wait_ms_p50": float(np.percentile(a[:, 1], 50)), "wait_ms_p95": float(np.percentile(a[:, 1], 95))})
    return out
