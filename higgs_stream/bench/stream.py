"""The stream section: the real streaming pipeline (stream/pipeline.py, Code2Wav adapter, codec on the
GPU) in this process under N concurrent streams arriving over time, and its A/B variants (`--compare-*`,
`--pacing`: the same runs with one setting changed)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import numpy as np
import torch

from higgs_stream.bench.measure import log
from higgs_stream.bench.model import FRAMES, TEXT, TOP_K
from higgs_stream.bench.trace import trace_summary
from higgs_stream.engine.engine import Engine
from higgs_stream.engine.errors import CapacityError

SAMPLE_RATE = 24000


class _Timer:
    """Wraps a callable on an instance and adds up its wall time."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name, self.fn = obj, name, getattr(obj, name)
        self.total, self.calls = 0.0, 0
        self.first: list[float] = []  # durations of the first calls since the last take()
        setattr(obj, name, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            self.total += dt
            self.calls += 1
            if len(self.first) < 4:
                self.first.append(dt)

    def take(self) -> tuple[float, int]:
        out = (self.total, self.calls)
        self.total, self.calls, self.first = 0.0, 0, []
        return out


async def _stream_run(pipeline: Any, n: int, mode: str, arrival_s: float, seed: int,
                      timers: tuple[_Timer, _Timer] | None = None, trace: bool = False) -> dict:
    from higgs_stream.stream.handle import Audio
    from higgs_stream.stream.messages import ContextOptions
    from higgs_stream.stream.metrics import UnderrunMeter
    from higgs_stream.stream.voices import Voice

    loop = asyncio.get_running_loop()

    async def one(i: int) -> dict:
        await asyncio.sleep(arrival_s * i / max(n, 1))
        t0 = loop.time()
        try:
            h = pipeline.open(ContextOptions(voice=Voice(name="default"), mode=mode, seed=seed + i, top_k=TOP_K),
                              transport="bench")
        except CapacityError:  # admission control: the server would answer `busy`
            return {"ttfa": None, "start": t0, "end": t0, "audio_s": 0.0, "underruns": 0, "max_gap_s": 0.0,
                    "reason": "busy"}
        h.say(TEXT)
        h.close()
        meter, first, samples, late = UnderrunMeter(SAMPLE_RATE), None, 0, []
        while True:
            events = await h.next(1 << 30)
            now = loop.time()
            for ev in events:
                if isinstance(ev, Audio):
                    first = now if first is None else first
                    if meter.chunk(now, len(ev.pcm) // 2):
                        late.append(samples / SAMPLE_RATE)  # audio position (s) where the listener ran dry
                    samples += len(ev.pcm) // 2
                else:
                    return {"ttfa": (first - t0) if first is not None else None, "start": t0, "end": now,
                            "audio_s": samples / SAMPLE_RATE, "underruns": meter.underruns,
                            "max_gap_s": meter.max_gap_s, "reason": ev.reason, "late_at_s": late}

    if timers:
        for t in timers:
            t.take()
    steps0, loop0 = pipeline.steps, pipeline.metrics.step_time.sum
    if trace:
        pipeline.trace = pipeline.codec_worker.trace = []
        pipeline.engine.runner.replay_events = []
    t_start = loop.time()
    rows = await asyncio.gather(*(one(i) for i in range(n)))
    traced, pipeline.trace, pipeline.codec_worker.trace = pipeline.trace, None, None
    runner = pipeline.engine.runner
    replays, runner.replay_events = getattr(runner, "replay_events", None), None
    if traced and replays:
        torch.cuda.synchronize()
        traced = traced + [("replay", t, rows, start.elapsed_time(end) / 1e3) for t, rows, start, end in replays]
    refused = sum(r["reason"] == "busy" for r in rows)
    rows = [r for r in rows if r["reason"] != "busy"] or [{"ttfa": None, "start": t_start, "end": loop.time(),
                                                           "audio_s": 0.0, "underruns": 0, "max_gap_s": 0.0,
                                                           "reason": "busy"}]
    loop_stats = {"refused_busy": refused}
    if timers:
        first_steps, first_codec = [x * 1e3 for x in timers[0].first], [x * 1e3 for x in timers[1].first]
        (step_s, step_n), (codec_s, codec_n) = (t.take() for t in timers)
        steps = pipeline.steps - steps0
        loop_s = pipeline.metrics.step_time.sum - loop0  # engine.step + routing, per engine-thread iteration
        loop_stats |= {"engine_steps": steps, "engine_step_s": step_s, "codec_calls": codec_n,
                      "codec_s": codec_s, "mean_step_ms": step_s / max(step_n, 1) * 1e3,
                      "loop_ms": loop_s / max(steps, 1) * 1e3,
                      "route_ms": (loop_s - step_s) / max(steps, 1) * 1e3,
                      "first_steps_ms": first_steps, "first_codec_ms": first_codec}
    wall = max(r["end"] for r in rows) - t_start
    ttfa = np.array([r["ttfa"] for r in rows if r["ttfa"] is not None] or [np.nan])
    rtf = np.array([(r["end"] - r["start"]) / r["audio_s"] for r in rows if r["audio_s"] > 0] or [np.nan])
    audio = sum(r["audio_s"] for r in rows)
    return {"n": n, "mode": mode, "arrival_s": arrival_s, "completed": sum(r["reason"] == "completed" for r in rows),
            "ttfa_p50_ms": float(np.percentile(ttfa, 50) * 1e3), "ttfa_p95_ms": float(np.percentile(ttfa, 95) * 1e3),
            "ttfa_max_ms": float(ttfa.max() * 1e3), "rtf_p50": float(np.percentile(rtf, 50)),
            "rtf_max": float(rtf.max()), "underruns": int(sum(r["underruns"] for r in rows)),
            "streams_with_underrun": int(sum(r["underruns"] > 0 for r in rows)),
            "audio_s_total": audio, "wall_s": wall, "audio_s_per_s": audio / wall,
            "max_gap_ms": float(max(r["max_gap_s"] for r in rows) * 1e3),
            "full_length": int(sum(r["audio_s"] >= FRAMES * 0.04 - 1e-6 for r in rows)),
            "underruns_by_position_s": _histogram([x for r in rows for x in r.get("late_at_s", ())]),
            "paused_max": getattr(pipeline, "max_paused", None), **loop_stats,
            **({"trace": trace_summary(traced, wall)} if traced else {})}


def _histogram(positions: list[float]) -> dict[str, int]:
    """Underruns by where in the utterance they happened: the ramp-up or later."""
    edges = ((0.0, 0.5), (0.5, 1.5), (1.5, 4.0), (4.0, float("inf")))
    return {f"{lo:g}-{hi:g}s": sum(lo <= x < hi for x in positions) for lo, hi in edges}


class _CodecStats:
    """The pipeline's own codec counters, read like a _Timer."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline, self.first = pipeline, []
        self._at = (0.0, 0)

    def take(self) -> tuple[float, int]:
        p = self.pipeline
        now = (p.codec_busy_s, p.codec_calls)
        out = (now[0] - self._at[0], now[1] - self._at[1])
        self._at = now
        return out


async def stream_bench(engine: Engine, codec: Any, runs: list[tuple[int, str, int]],
                       codec_stream: str = "separate", pacing: dict | None = None, trace: bool = False,
                       partition_steps: bool = True, gil_switch_s: float | None = None,
                       codec_sms: int | None = None) -> list[dict]:
    """runs: (N streams, mode, repeats). Streams arrive uniformly over min(2 s, N * 10 ms)."""
    from higgs_stream.stream.config import ServerConfig
    from higgs_stream.stream.gc_pauses import freeze_startup
    from higgs_stream.stream.pipeline import Pipeline

    n_max = max(n for n, _, _ in runs)
    cfg = ServerConfig(max_streams=n_max + 8, max_frames=FRAMES, history_segments=0, stream_buffer_s=120.0,
                       codec_sms=codec_sms, **(pacing or {}))
    pipeline = Pipeline(engine, codec, cfg, codec_stream=codec_stream)
    pipeline.codec_worker.code2wav.partition_steps = partition_steps
    t0 = time.perf_counter()
    switch = sys.getswitchinterval()  # the process's, restored at the end (the pipeline sets its own)
    await pipeline.start()  # warms the codec up at its bucketed shapes, captures the small ones
    if gil_switch_s is not None:
        sys.setswitchinterval(gil_switch_s)
    log(f"pipeline started in {time.perf_counter() - t0:.1f} s (codec warm-up, codec stream {codec_stream}, "
        f"graph shapes {len(getattr(pipeline.decoder, 'shapes', ()))}, graph check "
        f"{getattr(pipeline.decoder, 'check_max_abs_diff', None)})")
    timers = (_Timer(engine, "step"), _CodecStats(pipeline))
    out = []
    try:
        for mode in ("exact", "low_latency"):  # warm-up (codec shapes, allocator)
            await _stream_run(pipeline, 4, mode, 0.0, 7)
        if cfg.gc_freeze:  # as `serve` does after its warm-up (stream/gc_pauses.py)
            freeze_startup()
        for n, mode, repeats in runs:
            for r in range(repeats):
                res = await _stream_run(pipeline, n, mode, min(2.0, n * 0.01), 1000 * r, timers, trace=trace and n > 1)
                res["repeat"] = r
                res["codec_stream"] = codec_stream
                res["partition_steps"] = partition_steps
                res["gil_switch_ms"] = sys.getswitchinterval() * 1e3
                res["codec_sms"] = codec_sms
                out.append(res)
                log(f"stream n={n} {mode}: TTFA p50 {res['ttfa_p50_ms']:.1f} ms p95 {res['ttfa_p95_ms']:.1f} ms, "
                    f"RTF p50 {res['rtf_p50']:.3f}, underruns {res['underruns']} in {res['streams_with_underrun']} streams, "
                    f"refused {res.get('refused_busy', 0)}, {res['audio_s_per_s']:.1f} audio-s/s, "
                    f"underruns at {res['underruns_by_position_s']}, max gap {res['max_gap_ms']:.0f} ms, "
                    f"full {res['full_length']}/{n}, steps {res.get('engine_steps')} ({res.get('mean_step_ms', 0):.2f} ms, "
                    f"loop {res.get('loop_ms', 0):.2f} ms), "
                    f"codec {res.get('codec_calls')} calls {res.get('codec_s', 0):.2f} s of {res['wall_s']:.2f} s"
                    + (f"; first steps {[round(x, 2) for x in res['first_steps_ms']]} ms" if n == 1 else "")
                    + (f"; trace {json.dumps(res['trace'])}" if "trace" in res else ""))
    finally:
        sys.setswitchinterval(switch)
        await pipeline.stop()
        del engine.step  # drop the _Timer (an instance attribute) for the next pipeline
    return out


def ab_variants(args: argparse.Namespace) -> list[dict]:
    """stream_bench keyword sets of the --compare-* flags: each changes one setting of the default run."""
    out: list[dict] = [{"codec_stream": "engine"}] if args.compare_codec_stream else []  # back to back on the device
    out += [{"codec_sms": int(n)} for n in filter(None, args.compare_codec_sms.split(","))]
    out += [{"gil_switch_s": float(ms) / 1e3} for ms in filter(None, args.compare_gil_switch.split(","))]
    return out + ([{"partition_steps": False}] if args.compare_codec_partition else [])
