"""What a run reports: progress lines, one scenario's metrics from its per-request records
(`summarize`), the table printed at the end and the plot. docs/LOADGEN.md has every metric."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from higgs_stream.loadgen.listener import SAMPLE_RATE
from higgs_stream.loadgen.schedule import Scenario

CONTINUITY_MS = (50, 100, 200)


def log(msg: str) -> None:
    print(f"[loadgen {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values]
    return {"n": len(ms), "p50": percentile(ms, 50), "p95": percentile(ms, 95), "p99": percentile(ms, 99),
            "mean": sum(ms) / len(ms) if ms else None, "max": max(ms) if ms else None}


def summarize(scenario: Scenario, records: list[dict], wall_s: float, gpu: list[float] | None,
              lags: list[dict]) -> dict:
    """One scenario's metrics from its per-request records (see docs/LOADGEN.md)."""
    heard = [r for r in records if r["first_audio"] is not None]
    audio_s = sum(r["samples"] for r in records) / SAMPLE_RATE
    outcomes = [r["outcome"] for r in records]
    codes: dict[str, int] = {}
    for r in records:
        if r["error_code"]:
            codes[r["error_code"]] = codes.get(r["error_code"], 0) + 1
    with_underrun = sum(r["underruns"] > 0 for r in heard)
    replicas: dict[str, int] = {}  # requests per Ray Serve replica (none for a standalone server)
    for r in records:
        if r.get("replica"):
            replicas[r["replica"]] = replicas.get(r["replica"], 0) + 1
    return {
        "name": scenario.name, "kind": scenario.kind, "load": scenario.load, "duration_s": scenario.duration_s,
        "seed": scenario.seed, "count": scenario.count, "requests": len(records),
        "completed": outcomes.count("completed"), "errored": outcomes.count("error") + outcomes.count("timeout"),
        "busy": outcomes.count("busy"), "timed_out": outcomes.count("timeout"), "error_codes": codes,
        "ttfa_ms": _ms([r["ttfa_s"] for r in heard]),
        "ttfa_later_ms": _ms([r["ttfa_s"] for r in later_requests(heard)]) if scenario.kind == "closed" else None,
        "underruns": sum(r["underruns"] for r in heard), "underrun_s": sum(r["stall_s"] for r in heard),
        "streams_with_audio": len(heard), "streams_with_underrun": with_underrun,
        "underrun_share": with_underrun / len(heard) if heard else None,
        "max_stall_ms": max((r["max_stall_s"] for r in heard), default=0.0) * 1e3,
        "continuity": {str(ms): (sum(r["max_stall_s"] * 1e3 <= ms for r in heard) / len(heard) if heard else None)
                       for ms in CONTINUITY_MS},
        "audio_s": audio_s, "wall_s": wall_s, "audio_s_per_s": audio_s / wall_s if wall_s > 0 else None,
        "samples_per_stream": {"min": min((r["samples"] for r in heard), default=None),
                               "max": max((r["samples"] for r in heard), default=None)},
        "gpu_busy": sum(gpu) / len(gpu) / 100 if gpu else None, "gpu_samples": len(gpu or ()), "replicas": replicas,
        "client": {"procs": len(lags), "send_lag_ms": _ms([r["sent"] - r["scheduled"] for r in records]),
                   "connect_ms": _ms([r["connect_s"] for r in records if r["connect_s"] is not None]),
                   "loop_lag_ms_max": max((x["loop_lag_s_max"] for x in lags), default=0.0) * 1e3},
        "streams": records,
    }


def later_requests(heard: list[dict]) -> list[dict]:
    """Closed loop: every worker's requests after its first one with audio. The first ones arrive together
    (all workers start within `--ramp`): a burst no steady load has, so its TTFA is a population of its own."""
    seen: set = set()
    later = []
    for r in sorted(heard, key=lambda r: r["sent"]):
        if r.get("worker") in seen:
            later.append(r)
        seen.add(r.get("worker"))
    return later


def brief(s: dict) -> str:
    t = s["ttfa_ms"]
    return (f"{s['requests']} requests, {s['completed']} completed, {s['errored']} errored, {s['busy']} busy; "
            f"TTFA p50 {_fmt(t['p50'], '.0f')} p95 {_fmt(t['p95'], '.0f')} ms; underruns {s['underruns']} "
            f"({s['streams_with_underrun']}/{s['streams_with_audio']} streams); {s['audio_s_per_s'] or 0:.1f} audio-s/s")


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict) -> str:
    head = (f"{'scenario':<14}{'sent':>6}{'ok':>6}{'err':>5}{'busy':>6}{'TTFA p50':>10}{'p95':>8}{'p99':>8}{'p95 later':>10}"
            f"{'underruns':>10}{'stall s':>9}{'w/ und.':>8}{'cont100':>8}{'audio-s/s':>10}{'GPU':>6}")
    lines = [head]
    for s in result["scenarios"]:
        t, later = s["ttfa_ms"], (s.get("ttfa_later_ms") or {}).get("p95")  # older results lack it
        lines.append(f"{s['name']:<14}{s['requests']:>6}{s['completed']:>6}{s['errored']:>5}{s['busy']:>6}"
                     f"{_fmt(t['p50'], '.0f'):>10}{_fmt(t['p95'], '.0f'):>8}{_fmt(t['p99'], '.0f'):>8}"
                     f"{_fmt(later, '.0f'):>10}{s['underruns']:>10}"
                     f"{s['underrun_s']:>9.2f}{s['streams_with_underrun']:>8}{_fmt(s['continuity']['100'], '.2f'):>8}"
                     f"{_fmt(s['audio_s_per_s'], '.1f'):>10}{_fmt(s['gpu_busy'], '.0%'):>6}")
    if result.get("skipped"):
        lines.append(f"skipped (time budget): {', '.join(result['skipped'])}")
    return "\n".join(lines)


def plot(results: Sequence[dict], path: str | Path, labels: Sequence[str] | None = None) -> bool:
    """TTFA p50/p95 and underrun share vs load, one row per scenario family, one line per result."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not importable: no plot written to {path} (pip install matplotlib; "
            f"or re-plot later with --plot-from JSON --plot PNG)")
        return False
    labels = list(labels or [r.get("label") or f"run {i}" for i, r in enumerate(results)])
    kinds = [k for k in ("open", "closed") if any(s["kind"] == k for r in results for s in r["scenarios"])]
    if not kinds:
        log("nothing to plot (no scenarios ran)")
        return False
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 3.8 * len(kinds)), squeeze=False)
    nan = float("nan")
    for row, kind in zip(axes, kinds):
        for i, (r, label) in enumerate(zip(results, labels)):
            ss = sorted((s for s in r["scenarios"] if s["kind"] == kind), key=lambda s: s["load"])
            x, color = [s["load"] for s in ss], f"C{i}"
            for q, style in (("p50", "-o"), ("p95", "--s")):
                row[0].plot(x, [_or(s["ttfa_ms"][q], nan) for s in ss], style, color=color, label=f"{label} TTFA {q}")
            row[1].plot(x, [_or(s["underrun_share"], nan) for s in ss], "-o", color=color,
                        label=f"{label} streams with an underrun")
            row[1].plot(x, [s["busy"] / s["requests"] if s["requests"] else nan for s in ss], ":x", color=color,
                        label=f"{label} busy-refused")
        loads = [s["load"] for r in results for s in r["scenarios"] if s["kind"] == kind]
        xlabel = "arrival rate (requests/s, Poisson)" if kind == "open" else "concurrent streams (closed loop)"
        row[0].set(xlabel=xlabel, ylabel="time to first audio (ms)", title=f"{kind} loop: TTFA")
        row[1].set(xlabel=xlabel, ylabel="share of requests", ylim=(-0.02, 1.02), title=f"{kind} loop: underruns")
        for ax in row:
            if max(loads) >= 8 * min(loads):
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"plot written to {path}")
    return True
