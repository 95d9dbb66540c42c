"""GPU benchmark of the full-size Higgs Audio v2 talker with random weights (one command):

    python -m higgs_stream.bench --out bench.json

Sections (all in one run, on one GPU, numbers named after the card):
  parity    our bf16 fast path vs transformers' fp32 reference: audio log-prob deltas; greedy codes
            of the graphed batched engine vs the eager batch-1 engine (several streams, 200 steps)
  baseline  transformers' `generate` with the same weights (bf16, batch 1): frames/s
  decode    graph-replayed decode step time vs batch size beside the weight-read floor from a copy
            bandwidth measured in this run
  stream    the real streaming pipeline (stream/pipeline.py, Code2Wav adapter, codec on the GPU)
            under N concurrent streams arriving over time: TTFA, per-stream RTF, underruns of a
            real-time listener, aggregate audio seconds per second
`--arch v3|qwen3-tts [--preset ...]` runs the decode and profile sections on that family's random
model drawn in memory (Qwen3-TTS: `full` = 0.6B, `1.7b`; a decode step is then a whole frame: the
talker step, the code predictor's 15 sub-steps and the sampling of all 16 groups, one graph).
Random weights never stop by themselves: utterances end at the frame cap (250 frames = 10 s).
`--quantize fp8|int8` runs every section on the quantized talker; `python -m higgs_stream.bench_quant`
runs the modes side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from higgs_stream.bench_model import batch_vs_single, logprob_parity
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import CapacityError
from higgs_stream.engine.gpu_sampling import StreamStart
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.models.higgs_v2.prompt import build_prompt
from higgs_stream.engine.models.higgs_v2.random_weights import (
    random_reference,
    talker_from_reference,
    tokenizer_and_config,
)
from higgs_stream.engine.quantize import quantize_talker
from higgs_stream.engine.models.registry import DEFAULT_ARCH, FAMILIES
from higgs_stream.engine.random_weights import EOS_TOP_K, in_memory_engine, random_full_codec, suppress_eos
from higgs_stream.engine.request import GenerationRequest, SamplingParams

TEXT = ("The quick brown fox jumps over the lazy dog while the morning train rolls into the station, "
        "and she said good morning, how are you today, before the whole sentence had been spoken.")
FRAMES = 250  # 10 s at 25 frames/s
TOP_K = EOS_TOP_K  # with the EOS rows of the random audio head zeroed, EOS (logit 0) never makes the top 50
SAMPLE_RATE = 24000


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- measurements
def copy_bandwidth(gib: float = 2.0, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written per second)."""
    n = int(gib * (1 << 30)) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n * 4 / float(np.median(times))


def greedy_batch_parity(engine: Engine, eager: Engine, n: int = 6, steps: int = 200, ras_window: int = 0) -> dict:
    """Greedy codes of n concurrent streams (different prompt lengths, same seeds) through the graphed
    batched engine vs each stream alone through the eager batch-1 engine."""
    texts = [TEXT[: 20 + 37 * i] for i in range(n)]
    reqs = [GenerationRequest(text=t, sampling=SamplingParams(temperature=0.0, seed=100 + i, ras_window=ras_window),
                              max_frames=steps) for i, t in enumerate(texts)]
    alone = [eager.generate(r) for r in reqs]
    sids = {engine.add(r): i for i, r in enumerate(reqs)}
    frames: dict[int, list] = {i: [] for i in range(n)}
    open_ = set(sids)
    while open_ or engine.has_work():
        for ev in engine.step():
            if ev.frame is not None:
                frames[sids[ev.stream_id]].append(ev.frame)
            if ev.finished:
                open_.discard(ev.stream_id)
    rows = []
    for i in range(n):
        got, want = np.stack(frames[i], axis=1) if frames[i] else np.zeros((8, 0), np.int64), alone[i]
        m = min(got.shape[1], want.shape[1])
        diff = np.nonzero((got[:, :m] != want[:, :m]).any(axis=0))[0]
        rows.append({"prompt_len": len(build_prompt(engine.tokenizer, reqs[i], 8, 1024)), "frames": int(got.shape[1]),
                     "frames_alone": int(want.shape[1]), "equal": bool(got.shape == want.shape and not len(diff)),
                     "first_diff_frame": int(diff[0]) if len(diff) else None})
    return {"ras_window": ras_window, "streams": rows, "all_equal": all(r["equal"] for r in rows)}


@torch.inference_mode()
def decode_sweep(engine: Engine, batches: list[int], context: int, weight_bytes: int, bw: float, reps: int = 30) -> list[dict]:
    """Decode step time at each batch size: graph replay alone (device time) and the full host+device
    step (staging, FlashInfer plan, replay), each stream holding `context` tokens of random K/V."""
    cfg, alloc, ps = engine.cfg, engine.cache.allocator, engine.cache.allocator.page_size
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.cache.pool.k.element_size()
    out = []
    for b in batches:
        sids = [2**40 + i for i in range(b)]
        slots = [engine.runner._free_slots[-1 - i] for i in range(b)]
        for sid in sids:
            alloc.reserve(sid, context)
        engine.runner.state.start([StreamStart(s, SamplingParams(temperature=0.7, seed=s), 10**6,
                                               np.zeros((cfg.num_codebooks, 0), np.int64)) for s in slots])
        tables = [alloc.page_table(s) for s in sids]
        pos = context - 1
        args = ([pos] * b, [t[pos // ps] * ps + pos % ps for t in tables], slots, tables, [context] * b)
        for _ in range(3):
            engine.runner.graphs.run(*args)
        torch.cuda.synchronize()
        graph = engine.runner.graphs._graphs[engine.runner.graphs.bucket_for(b)]
        times = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        t0 = time.perf_counter()
        for _ in range(reps):
            engine.runner.graphs.run(*args)
        torch.cuda.synchronize()
        full = (time.perf_counter() - t0) / reps
        for sid in sids:
            alloc.free(sid)
        for s in slots:
            engine.runner.state.release(s)
        replay = float(np.median(times))
        floor_w = weight_bytes / bw
        floor_kv = (weight_bytes + b * context * kv_token_bytes) / bw
        out.append({"batch": b, "bucket": engine.runner.graphs.bucket_for(b), "context": context, "replay_ms": replay * 1e3,
                    "step_ms": full * 1e3, "floor_weights_ms": floor_w * 1e3, "floor_weights_kv_ms": floor_kv * 1e3,
                    "replay_over_floor": replay / floor_kv, "frames_per_s": b / full})
        log(f"decode b={b}: replay {replay*1e3:.3f} ms, step {full*1e3:.3f} ms, floor {floor_kv*1e3:.3f} ms")
    return out


@torch.inference_mode()
def transformers_baseline(hf: torch.nn.Module, engine: Engine, steps: int = 48) -> dict:
    """transformers' generate at batch 1 (the reference in bf16, greedy): frames per second."""
    req = GenerationRequest(text=TEXT, sampling=SamplingParams(temperature=0.0))
    prompt = build_prompt(engine.tokenizer, req, 8, 1024)
    ids = torch.from_numpy(prompt.input_ids)[None].cuda()
    hf.generate(input_ids=ids, max_new_tokens=4, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, max_new_tokens=steps, do_sample=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    seq = out if isinstance(out, torch.Tensor) else out.sequences
    made = int(seq.shape[1]) if seq.dim() == 3 else int(seq.shape[-1] - ids.shape[1])
    return {"method": "HiggsAudioV2ForConditionalGeneration.generate (bf16, greedy, batch 1)", "steps": made,
            "wall_s": wall, "ms_per_step": wall / max(made, 1) * 1e3, "frames_per_s": made / wall}


@torch.inference_mode()
def profile_decode(engine: Engine, batch: int, context: int = 300, top: int = 12) -> dict:
    """GPU time per kernel of one eager decode step (the graph's body), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    alloc, ps, g = engine.cache.allocator, engine.cache.allocator.page_size, engine.runner.graphs
    sids = [2**41 + i for i in range(batch)]
    slots = [engine.runner._free_slots[-1 - i] for i in range(batch)]
    for sid in sids:
        alloc.reserve(sid, context)
    tables = [alloc.page_table(s) for s in sids]
    pos = context - 1
    b = g.bucket_for(batch)
    g._stage(b, [pos] * batch, [t[pos // ps] * ps + pos % ps for t in tables], slots, tables, [context] * batch)
    for _ in range(2):
        g._body(b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g._body(b)
        torch.cuda.synchronize()
    for sid in sids:
        alloc.free(sid)
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.count:
            rows.append((t, ev.count, ev.key))
    kernels = [r for r in rows if not r[2].startswith(("cudaLaunch", "Memcpy", "Memset", "cuda"))]
    total = sum(t for t, _, _ in kernels)
    kernels.sort(reverse=True)
    return {"batch": batch, "bucket": b, "kernel_us_total": total, "kernels": sum(c for _, c, _ in kernels),
            "top": [{"us": t, "count": c, "name": k[:90]} for t, c, k in kernels[:top]]}


@torch.inference_mode()
def codec_timings(codec: Any, shapes: list[tuple[int, int]]) -> list[dict]:
    """Codec decode wall time (GPU, fp32, incl. the copy back) per [B, 8, F] shape: first call and warm."""
    out = []
    for b, f in shapes:
        codes = torch.randint(0, 1024, (b, 8, f))
        t0 = time.perf_counter()
        codec.decode(codes).cpu()
        first = time.perf_counter() - t0
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            codec.decode(codes).cpu()
            times.append(time.perf_counter() - t0)
        out.append({"batch": b, "frames": f, "first_ms": first * 1e3, "warm_ms": float(np.median(times)) * 1e3})
    return out


@torch.inference_mode()
def codec_variants(codec: Any, shape: tuple[int, int] = (32, 48)) -> dict:
    """Codec decode ms at one steady-state shape: as served (fp32, cuDNN heuristics), with cuDNN
    autotuning (still fp32), and with TF32 (not exact); max |d| of each against the served one."""
    b, f = shape
    codes = torch.randint(0, 1024, (b, 8, f), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {"batch": b, "frames": f}

    def timed() -> tuple[float, torch.Tensor]:
        ref = codec.decode(codes)
        codec.decode(codes)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            codec.decode(codes)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 5 * 1e3, ref

    out["fp32_ms"], base = timed()
    bench_flag = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = True
        out["fp32_autotuned_ms"], y = timed()
        out["fp32_autotuned_max_abs_diff"] = float((y - base).abs().max())
    finally:
        torch.backends.cudnn.benchmark = bench_flag
    try:
        codec.allow_tf32 = True
        out["tf32_ms"], y = timed()
        out["tf32_max_abs_diff"] = float((y - base).abs().max())
    finally:
        codec.allow_tf32 = False
    out["peak_abs"] = float(base.abs().max())
    return out


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


# ---------------------------------------------------------------------------- streaming
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
    overlapped = np.zeros(len(steps), dtype=bool)
    j = 0
    for i, t in enumerate(steps):  # steps and calls are in time order: one pass
        while j < len(calls) and calls[j][2] < t[1]:
            j += 1
        overlapped[i] = j < len(calls) and calls[j][1] < t[3]
    dur = arr([c[2] - c[1] for c in calls]) if calls else np.zeros(1)
    pct = lambda a, q: float(np.percentile(a, q)) if a.size else float("nan")
    return {"steps": len(steps), "step_ms_p50": pct(wall, 50), "step_ms_p95": pct(wall, 95),
            "engine_host_ms": float((engine - wait).mean()), "engine_wait_ms": float(wait.mean()),
            "route_ms": float(route.mean()),
            "step_ms_with_prefill": _mean(wall[prefill]), "step_ms_without_prefill": _mean(wall[~prefill]),
            "share_of_steps_with_prefill": float(prefill.mean()),
            "step_ms_with_codec": float(wall[overlapped].mean()) if overlapped.any() else None,
            "step_ms_without_codec": float(wall[~overlapped].mean()) if (~overlapped).any() else None,
            "share_of_steps_with_codec": float(overlapped.mean()),
            "codec_calls": len(calls), "codec_ms_p50": pct(dur, 50), "codec_ms_p95": pct(dur, 95),
            "codec_jobs_mean": float(np.mean([c[3] for c in calls])) if calls else 0.0,
            "codec_frames_mean": float(np.mean([c[4] for c in calls])) if calls else 0.0,
            "codec_steps": (calls[-1][5] - calls[0][5] + 1) if calls else 0,
            "codec_busy_share": float(dur.sum() / 1e3 / wall_s) if calls else 0.0,
            **_replay_summary(replays, calls)}


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
    from higgs_stream.stream.pipeline import Pipeline

    n_max = max(n for n, _, _ in runs)
    cfg = ServerConfig(max_streams=n_max + 8, max_frames=FRAMES, history_segments=0, stream_buffer_s=120.0,
                       codec_sms=codec_sms, **(pacing or {}))
    pipeline = Pipeline(engine, codec, cfg, codec_stream=codec_stream)
    pipeline.codec_worker.code2wav.partition_steps = partition_steps
    t0 = time.perf_counter()
    await pipeline.start()  # warms the codec up at its bucketed shapes, captures the small ones
    switch = sys.getswitchinterval()
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


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m higgs_stream.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--sections", default="parity,baseline,profile,decode,stream")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--streams", default="1,16,64,128,256")
    ap.add_argument("--context", type=int, default=300, help="tokens of K/V per stream in the decode sweep")
    ap.add_argument("--kv-pages", type=int, default=9000)
    ap.add_argument("--no-graphs", action="store_true", help="debug: run decode steps eagerly")
    ap.add_argument("--pacing", default=None, metavar="PAUSE,RESUME,SATURATED",
                    help="also run N > 1 with these pause/resume seconds and saturation ratio (A/B)")
    ap.add_argument("--compare-codec-stream", action="store_true",
                    help="also run N > 1 with the codec on the talker's CUDA stream")
    ap.add_argument("--compare-codec-partition", action="store_true",
                    help="also run N > 1 with every codec call's pushes in one step (no partition by width)")
    ap.add_argument("--compare-gil-switch", default="", metavar="MS,...",
                    help="also run N > 1 with these GIL switch intervals (the pipeline sets 1 ms)")
    ap.add_argument("--compare-codec-sms", default="", metavar="N,...",
                    help="also run N > 1 with the codec on a green context of these many SMs")
    ap.add_argument("--trace", action="store_true", help="time every engine step and codec call of N > 1 runs")
    ap.add_argument("--low-latency-streams", default="16,128", help="N that also run in low-latency mode")
    ap.add_argument("--quantize", choices=("none", "fp8", "int8"), default="none",
                    help="quantize the talker's backbone linears before every section (side by side: bench_quant)")
    ap.add_argument("--arch", choices=[f.arch for f in FAMILIES], default=DEFAULT_ARCH,
                    help=f"model family; other than {DEFAULT_ARCH}: the decode and profile sections only")
    ap.add_argument("--preset", default="full", help="the family's random-weight preset (not for the default arch)")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    if args.arch != DEFAULT_ARCH and sections - {"decode", "profile"}:
        ap.error(f"--arch {args.arch} runs the decode and profile sections only, not {sorted(sections - {'decode', 'profile'})}")
    assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU"
    torch.backends.cuda.matmul.allow_tf32 = False
    result: dict[str, Any] = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "python": platform.python_version(), "sections": sorted(sections)}
    try:
        import flashinfer
        import triton
        result.update(flashinfer=flashinfer.__version__, triton=triton.__version__)
    except ImportError as exc:
        result["import_error"] = repr(exc)
    out_path = Path(args.out)

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=2))

    bw = copy_bandwidth()
    result["copy_bandwidth_GBps"] = bw / 1e9
    log(f"{result['card']}: copy bandwidth {bw/1e9:.0f} GB/s")

    config = EngineConfig(max_batch=256, token_budget=4096, max_waiting=1024, max_seq_len=4096,
                          kv_pages=args.kv_pages, page_size=16)
    result.update(quantize=args.quantize, arch=args.arch)
    if args.arch != DEFAULT_ARCH:  # the family's random model, drawn in memory, EOS suppressed
        result["preset"] = args.preset
        t0 = time.perf_counter()
        engine = in_memory_engine(args.arch, args.preset, "cuda", torch.bfloat16, config,
                                  cuda_graphs=not args.no_graphs, quantize=args.quantize)
        result["build_and_capture_s"] = time.perf_counter() - t0
        return _other_arch(engine, result, args, bw, save)
    tok, cfg = tokenizer_and_config("full")
    t0 = time.perf_counter()
    hf = random_reference(cfg, "cuda")
    talker = talker_from_reference(hf, cfg, torch.bfloat16)
    quantize_talker(talker, args.quantize)
    log(f"random full-size model built in {time.perf_counter() - t0:.1f} s (quantize {args.quantize})")
    cache = KVCache.create(cfg, num_pages=config.kv_pages, page_size=16, dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    engine = Engine(talker, cfg, tok, cache, config, ModelRunnerConfig(cuda_graphs=not args.no_graphs))
    result["graph_capture_s"] = time.perf_counter() - t0
    weight_bytes = engine.runner.fast.audio_step_bytes()
    result["audio_step_weight_bytes"] = weight_bytes
    result["floor_batch1_ms"] = weight_bytes / bw * 1e3
    log(f"engine ready (capture {result['graph_capture_s']:.1f} s); audio step reads {weight_bytes/1e9:.2f} GB "
        f"-> floor {weight_bytes/bw*1e3:.3f} ms")
    save()

    if "parity" in sections:  # against the reference's whole audio head: before EOS is suppressed
        result["logprob_parity"] = logprob_parity(hf, engine)
        log(f"logprob parity: {result['logprob_parity']}")
    suppress_eos(engine)  # from here on every stream runs to its frame cap (top-k requests: TOP_K or less)
    if "parity" in sections:
        small = KVCache.create(cfg, num_pages=600, page_size=16, dtype=torch.bfloat16, device="cuda")
        eager = Engine(talker, cfg, tok, small, EngineConfig(max_batch=1, kv_pages=600, max_seq_len=4096),
                          ModelRunnerConfig(cuda_graphs=False), fast=engine.runner.fast)
        result["greedy_batch_parity"] = greedy_batch_parity(engine, eager, ras_window=0)
        result["greedy_batch_parity_ras"] = greedy_batch_parity(engine, eager, ras_window=7)
        result["batch_vs_single_logits"] = batch_vs_single(engine, eager)
        log(f"teacher-forced batched (graph) vs batch-1 (eager) logits: {result['batch_vs_single_logits']}")
        result["batch_vs_single_logits_batched_prefill"] = batch_vs_single(engine, eager, batched_prefill=True)
        log(f"... with the prompts prefilled together: {result['batch_vs_single_logits_batched_prefill']}")
        log(f"greedy batched (graphs) vs eager batch-1: {result['greedy_batch_parity']}")
        del eager, small
        save()
    if "baseline" in sections:
        hf.to(torch.bfloat16)
        try:
            result["transformers_baseline"] = transformers_baseline(hf, engine)
        except Exception as exc:  # report, keep benchmarking our path
            result["transformers_baseline"] = {"error": repr(exc)}
        log(f"transformers baseline: {result['transformers_baseline']}")
        save()
    del hf
    torch.cuda.empty_cache()
    if "profile" in sections and engine.runner.graphs is not None:
        result["profile"] = [profile_decode(engine, b) for b in (1, 64)]
        for p in result["profile"]:
            log(f"profile b={p['batch']}: {p['kernels']} kernels, {p['kernel_us_total']:.0f} us; top: "
                + "; ".join(f"{k['us']:.0f}us x{k['count']} {k['name'][:40]}" for k in p["top"][:8]))
        save()

    if "decode" in sections and engine.runner.graphs is not None:
        batches = [int(b) for b in args.batches.split(",")]
        result["decode"] = decode_sweep(engine, batches, args.context, weight_bytes, bw)
        base = result.get("transformers_baseline", {}).get("frames_per_s")
        if base:
            b1 = result["decode"][0]
            result["speedup_vs_transformers_batch1"] = b1["frames_per_s"] / base
        save()
    if "stream" in sections:
        codec = random_full_codec()
        result["codec"] = codec_timings(codec, [(1, 1), (1, 11), (1, 21), (1, 45), (8, 45), (32, 45), (64, 45)])
        log(f"codec: {result['codec']}")
        result["codec_variants"] = codec_variants(codec)
        log(f"codec variants (not used by the pipeline): {result['codec_variants']}")
        ns = [int(n) for n in args.streams.split(",")]
        runs = [(1, "low_latency", 5), (1, "exact", 5)] + [(n, "exact", 1) for n in ns if n > 1]
        low = {int(n) for n in args.low_latency_streams.split(",") if n}
        runs += [(n, "low_latency", 1) for n in ns if n in low]
        result["stream"] = asyncio.run(stream_bench(engine, codec, runs, trace=args.trace))
        if args.pacing:  # the same runs again with other pacing settings (an A/B in one process)
            pause, resume, saturated = (float(x) for x in args.pacing.split(","))
            other = {"pause_ahead_s": pause, "resume_ahead_s": resume, "saturated_step_ratio": saturated}
            for r in asyncio.run(stream_bench(engine, codec, [x for x in runs if x[0] > 1 and x[1] == "exact"],
                                              pacing=other, trace=args.trace)):
                result["stream"].append(dict(r, pacing=other))
        save()
        other = [(n, "exact", 1) for n in ns if n > 1]
        for variant in ab_variants(args) if other else []:  # the same N > 1 runs, one setting changed
            result["stream"] += asyncio.run(stream_bench(engine, codec, other, trace=args.trace, **variant))
            save()
    summarize(result)
    save()
    return 0


def _other_arch(engine: Engine, result: dict, args: argparse.Namespace, bw: float, save: Any) -> int:
    """The decode and profile sections on another family's random model (`--arch`)."""
    weight_bytes = engine.runner.fast.audio_step_bytes()
    result["audio_step_weight_bytes"] = weight_bytes
    result["floor_batch1_ms"] = weight_bytes / bw * 1e3
    log(f"{args.arch} {args.preset} ready in {result['build_and_capture_s']:.1f} s; a decode step reads "
        f"{weight_bytes/1e9:.2f} GB -> floor {weight_bytes/bw*1e3:.3f} ms")
    save()
    if "profile" in args.sections.split(",") and engine.runner.graphs is not None:
        result["profile"] = [profile_decode(engine, b) for b in (1, 64)]
        for p in result["profile"]:
            log(f"profile b={p['batch']}: {p['kernels']} kernels, {p['kernel_us_total']:.0f} us; top: "
                + "; ".join(f"{k['us']:.0f}us x{k['count']} {k['name'][:40]}" for k in p["top"][:8]))
        save()
    if "decode" in args.sections.split(",") and engine.runner.graphs is not None:
        result["decode"] = decode_sweep(engine, [int(b) for b in args.batches.split(",")], args.context,
                                        weight_bytes, bw)
    summarize(result)
    save()
    return 0


def ab_variants(args: argparse.Namespace) -> list[dict]:
    """stream_bench keyword sets of the --compare-* flags: each changes one setting of the default run."""
    out: list[dict] = [{"codec_stream": "engine"}] if args.compare_codec_stream else []  # back to back on the device
    out += [{"codec_sms": int(n)} for n in filter(None, args.compare_codec_sms.split(","))]
    out += [{"gil_switch_s": float(ms) / 1e3} for ms in filter(None, args.compare_gil_switch.split(","))]
    return out + ([{"partition_steps": False}] if args.compare_codec_partition else [])


def summarize(r: dict) -> None:
    print(f"\n== {r['card']}  copy {r['copy_bandwidth_GBps']:.0f} GB/s  audio-step weights "
          f"{r['audio_step_weight_bytes']/1e9:.2f} GB  floor {r['floor_batch1_ms']:.3f} ms")
    if "logprob_parity" in r:
        p = r["logprob_parity"]
        print(f"parity: mean |d| {p['mean_abs_delta_nat']:.4f} nat, p99 {p['p99_abs_delta_nat']:.4f} nat, "
              f"argmax agree {p['argmax_agreement']:.3f}")
        for key in ("greedy_batch_parity", "greedy_batch_parity_ras"):
            g = r.get(key)
            if g:
                print(f"greedy graphed-batched vs eager batch-1 (RAS window {g['ras_window']}): "
                      + ", ".join(f"{x['frames']}{'=' if x['equal'] else '!=@' + str(x['first_diff_frame'])}" for x in g["streams"]))
    if "batch_vs_single_logits" in r:
        print(f"batched vs batch-1 logits (teacher-forced): {r['batch_vs_single_logits']}")
    if "transformers_baseline" in r:
        print(f"transformers: {r['transformers_baseline']}")
    if "decode" in r:
        print(f"{'batch':>6} {'replay ms':>10} {'step ms':>9} {'floor ms':>9} {'x floor':>8} {'frames/s':>9}")
        for d in r["decode"]:
            print(f"{d['batch']:>6} {d['replay_ms']:>10.3f} {d['step_ms']:>9.3f} {d['floor_weights_kv_ms']:>9.3f} "
                  f"{d['replay_over_floor']:>8.2f} {d['frames_per_s']:>9.0f}")
        if "speedup_vs_transformers_batch1" in r:
            print(f"batch-1 speedup vs transformers: {r['speedup_vs_transformers_batch1']:.1f}x")
    if "stream" in r:
        print(f"{'N':>4} {'mode':>11} {'codec':>8} {'sms':>4} {'part':>4} {'gil':>4} {'TTFA p50':>9} {'p95':>7} {'RTF p50':>8} {'underruns':>9} "
              f"{'audio-s/s':>9} {'step ms':>8} {'loop ms':>8} {'codec s':>8} {'wall s':>7}")
        for s in r["stream"]:
            print(f"{s['n']:>4} {s['mode']:>11} {s.get('codec_stream', ''):>8} {s.get('codec_sms') or 'all':>4} "
                  f"{'y' if s.get('partition_steps', True) else 'n':>4} "
                  f"{s.get('gil_switch_ms', 0):>4.1f} "
                  f"{s['ttfa_p50_ms']:>9.1f} "
                  f"{s['ttfa_p95_ms']:>7.1f} {s['rtf_p50']:>8.3f} "
                  f"{s['underruns']:>9} {s['audio_s_per_s']:>9.1f} {s.get('mean_step_ms', 0):>8.2f} "
                  f"{s.get('loop_ms', 0):>8.2f} {s.get('codec_s', 0):>8.2f} {s['wall_s']:>7.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
