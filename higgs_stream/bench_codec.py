"""Codec-only GPU benchmark: the exact incremental decoder against today's windowed decode (one command):

    python -m higgs_stream.bench_codec --out codec.json

Full-size Higgs v2 codec, random weights, strict fp32 (no TF32), one GPU, every section in one run:
  parity     max |d| / peak of the stateful decoder (graph replay and eager) against `codec.decode` of
             whole utterances; the capture check; state bytes per stream
  stateful   StreamingDecoder.step with 25-, 5- and 1-frame steps per stream, CUDA-graph replay and eager
  windowed   today's exact stream decode: windows [10 | 25 | 10] = 45 frames through `codec.decode`
             (and through stream/codec_graphs.py's graphs), 25 frames kept per window
  one_shot   whole 250-frame utterances through `codec.decode`: the ceiling (no redundancy, no steps)
at batch 1, 16 and 128. Throughput is codec frames/s (25 frames = 1 audio second) per wall-clock second,
codes handed over from the host as the pipeline does. `--tiny --device cpu` is a quick smoke run.
`--stage-times B:C,...` first times each decoder stage of an eager B x C step and the FLOP rate it ran at
(`stage_times`): the full decoder does 13.6 GFLOP per audio second (0.544 a frame; counted on the CPU, session 27),
so the H200's 37.4k frames/s at 128 streams (session 26) ran its convolutions at ~20 TFLOP/s overall, about 30 % of
the card's 67 TFLOP/s of fp32 (CUDA cores, no tensor cores in strict fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from higgs_stream.bench.measure import timed
from higgs_stream.engine.codec import Codec, CodecConfig, StreamingDecoder
from higgs_stream.engine.codec.streaming import GEMM_MAX_RATE_OUT
from higgs_stream.engine.gpu_memory import HEADROOM_GB, bound_process_memory

WINDOW_CONTEXT = 10  # frames each side of a window today (the receptive field)
WINDOW_NEW = 25
UTTERANCE = 250  # frames (10 s)
STEP_ITERS = {1: 60, 5: 30, 25: 12}


def log(msg: str) -> None:
    print(f"[bench_codec {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def random_codec(tiny: bool, device: str, seed: int = 0) -> Codec:
    if not tiny:
        from higgs_stream.engine.random_weights import random_full_codec

        return random_full_codec(seed)  # the full-size codec the main benchmark uses
    from higgs_stream.engine.codec import codec_from_state_dict
    from higgs_stream.engine.codec.make import build_reference_model

    cfg = CodecConfig.tiny()
    return codec_from_state_dict(build_reference_model(cfg, seed).state_dict(), cfg, with_encoder=False).to(device)


def rate(kind: str, batch: int, frames: int, seconds: float, **extra: Any) -> dict:
    """frames: codec frames each call delivers per stream."""
    return {"kind": kind, "batch": batch, "frames_per_call": frames, "ms_per_call": seconds * 1e3,
            "frames_per_s": batch * frames / seconds, "audio_s_per_s": batch * frames / seconds / 25, **extra}


# ---------------------------------------------------------------------------- sections
def parity(codec: Codec, decs: dict[str, StreamingDecoder], lengths: list[int], step: int = 25,
           reference: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """Stream each utterance in `step`-frame pushes (all rows in one batch) and compare with one-shot
    (`reference`, default `codec.decode`)."""
    gen = torch.Generator().manual_seed(1)
    utts = [torch.randint(0, 1024, (8, f), generator=gen) for f in lengths]
    want = [(reference or codec.decode)(u[None])[0] for u in utts]
    out: dict[str, Any] = {"lengths": lengths, "frames_per_push": step}
    for name, dec in decs.items():
        slots = [dec.open() for _ in utts]
        got: list[list[torch.Tensor]] = [[] for _ in utts]
        try:
            for pos in range(0, max(lengths), step):
                rows = [i for i, f in enumerate(lengths) if pos < f]
                valid = [min(step, lengths[i] - pos) for i in rows]
                codes = torch.zeros((len(rows), 8, step), dtype=torch.long)
                for r, i in enumerate(rows):
                    codes[r, :, :valid[r]] = utts[i][:, pos:pos + valid[r]]
                final = [pos + v == lengths[i] for v, i in zip(valid, rows)]
                for r, a in zip(rows, dec.push([slots[i] for i in rows], codes, valid, final)):
                    got[r].append(a.clone())
        finally:
            for s in slots:
                dec.close(s)
        errs = [float((torch.cat(g) - w).abs().max() / w.abs().max()) for g, w in zip(got, want)]
        out[f"{name}_max_rel_err"] = max(errs)
        out[f"{name}_peak"] = max(float(w.abs().max()) for w in want)
    return out


@contextlib.contextmanager
def open_rows(dec: StreamingDecoder, batch: int, frames: int):
    """`batch` streams opened on `dec` and random codes [batch, 8, frames] for their steps; the streams closed after."""
    slots = [dec.open() for _ in range(batch)]
    try:
        yield slots, torch.randint(0, 1024, (batch, 8, frames))
    finally:
        for s in slots:
            dec.close(s)


def stateful(dec: StreamingDecoder, kind: str, batch: int, step: int, device: torch.device) -> dict:
    valid, final = [step] * batch, [False] * batch
    replays = dec.replays
    with open_rows(dec, batch, step) as (slots, codes):
        seconds = timed(lambda: dec.step(slots, codes, valid, final), STEP_ITERS.get(step, 20), device)
    return rate(kind, batch, step, seconds, replayed=dec.replays > replays)


def profile_step(dec: StreamingDecoder, batch: int, frames: int) -> dict:
    """Kernel time of one eager stateful step (B rows x C frames), grouped by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    with open_rows(dec, batch, frames) as (slots, codes):
        for _ in range(2):
            dec.step(slots, codes, [frames] * batch, [False] * batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.step(slots, codes, [frames] * batch, [False] * batch)
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(ev.name, []).append(ev.device_time / 1e3)
    top = sorted(({"name": k, "ms": sum(v), "count": len(v)} for k, v in kernels.items()), key=lambda k: -k["ms"])
    return {"batch": batch, "frames": frames, "kernels": sum(len(v) for v in kernels.values()),
            "kernel_ms": sum(k["ms"] for k in top), "top": top[:20]}


def stage_flops(stage, buf: torch.Tensor, out: torch.Tensor) -> float:
    """Multiply-adds x 2 of one decoder stage's convolutions for input buffer `buf` [B, Cin, H + n] and its
    output `out` [B, Cout, n * stride] (engine/codec/streaming.py `_advance`): a conv's k taps per output sample; a
    transposed conv's k outputs per input sample (every input of the buffer, the history's one too); a residual
    unit's dilated conv and its pointwise one per output sample. Snake and the skip's add are not counted."""
    m, b = stage.module, buf.shape[0]  # (groups = 1: streaming.plan accepts no other)
    if stage.kind == "conv":
        return 2.0 * b * out.shape[2] * m.weight.numel()
    if stage.kind == "conv_t":
        return 2.0 * b * buf.shape[2] * m.weight.numel()
    return 2.0 * b * out.shape[2] * (m.conv1.weight.numel() + m.conv2.weight.numel())


def stage_times(dec: StreamingDecoder, batch: int, frames: int, device: torch.device, iters: int = 3) -> dict:
    """Where one eager stateful step (B rows x C frames) spends its time, by decoder stage: each stage's `_advance`
    (its snake and convolutions) timed apart (CUDA events; on a CPU the wall clock), its FLOPs (`stage_flops`) and
    the rate they ran at; the rest of the step (quantizer, fc2, the states' gathers and scatters, the masks) is the
    step's time less the stages'. Medians of `iters` steps after one unrecorded step. Which convolutions run far
    below the card's fp32 rate is where an exact codec could still get faster (issue #10: its GPU time limits the
    streams a GPU carries)."""
    advance, cuda = dec._advance_stage, device.type == "cuda"
    marks: list[tuple] = []  # per stage call: (stage, flops, start, end)

    def clock():
        if not cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def timed_advance(i: int, buf: torch.Tensor, n: int) -> torch.Tensor:
        t0 = clock()
        y = advance(i, buf, n)
        marks.append((dec.stages[i], stage_flops(dec.stages[i], buf, y), t0, clock()))
        return y

    def seconds(t0, t1) -> float:
        return t0.elapsed_time(t1) / 1e3 if cuda else t1 - t0

    per_step: list[list[float]] = []
    totals: list[float] = []
    flops: list[float] = []
    dec._advance_stage = timed_advance
    try:
        with open_rows(dec, batch, frames) as (slots, codes):
            for i in range(iters + 1):
                marks.clear()
                t0 = clock()
                dec.step(slots, codes, [frames] * batch, [False] * batch)
                t1 = clock()
                if cuda:
                    torch.cuda.synchronize(device)
                if i:  # the first step is a warm-up (plans, allocations)
                    per_step.append([seconds(a, b) for _, _, a, b in marks])
                    totals.append(seconds(t0, t1))
                    flops = [f for _, f, _, _ in marks]
    finally:
        del dec._advance_stage  # the class's method again
    med = [float(np.median(col)) for col in zip(*per_step)]
    g, rows = dec.geometry, []
    for j, ((stage, *_), sec, f) in enumerate(zip(marks, med, flops)):
        m = stage.module
        cin = stage.channels
        cout = m.out_channels if stage.kind != "res" else m.conv2.out_channels
        rows.append({"stage": j, "kind": stage.kind, "in_channels": cin, "out_channels": cout,
                     "rate_hz": stage.rate_out * g.sample_rate / g.hop, "ms": 1e3 * sec, "gflop": f / 1e9,
                     "tflops": f / sec / 1e12})
    total = float(np.median(totals))
    return {"batch": batch, "frames": frames, "step_ms": 1e3 * total, "stages_ms": sum(r["ms"] for r in rows),
            "rest_ms": 1e3 * total - sum(r["ms"] for r in rows), "gflop": sum(flops) / 1e9,
            "tflops": sum(flops) / total / 1e12, "stages": rows}


def windowed(decode: Callable[[torch.Tensor], torch.Tensor], kind: str, batch: int, device: torch.device) -> dict:
    codes = torch.randint(0, 1024, (batch, 8, 2 * WINDOW_CONTEXT + WINDOW_NEW))
    hop = 960

    def call() -> torch.Tensor:
        return decode(codes)[:, WINDOW_CONTEXT * hop:(WINDOW_CONTEXT + WINDOW_NEW) * hop]

    return rate(kind, batch, WINDOW_NEW, timed(call, 10, device))


def one_shot(codec: Codec, batch: int, device: torch.device) -> dict:
    """`batch` whole utterances through `codec.decode`, each frame decoded once: the ceiling. Under the served
    memory bound a whole batch of 128 does not fit an H200's headroom (its activations are the whole audio), so
    the utterances go through in the largest sub-batch that fits (halved after each out-of-memory; `sub_batch` in
    the row): the same frames, each decoded once."""
    codes = torch.randint(0, 1024, (batch, 8, UTTERANCE))
    sub = batch
    while True:
        def call(parts: tuple[torch.Tensor, ...] = codes.split(sub)) -> list[torch.Tensor]:
            return [codec.decode(p) for p in parts]

        try:
            seconds = timed(call, 3, device, warmup=1)
            return rate("one_shot", batch, UTTERANCE, seconds, sub_batch=sub)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if sub == 1:
                return {"kind": "one_shot", "batch": batch, "frames_per_call": UTTERANCE, "error": "out of memory"}
            sub //= 2  # >= 1: sub was >= 2 here


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m higgs_stream.bench_codec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write (rewritten after every section)")
    ap.add_argument("--batches", default="1,16,128")
    ap.add_argument("--steps", default="25,5,1", help="frames per stateful step")
    ap.add_argument("--tiny", action="store_true", help="tiny codec (smoke run; numbers mean nothing)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-tf32", action="store_true", help="skip the opt-in TF32 codec section")
    ap.add_argument("--profile", default="", metavar="B:C,...",
                    help="CUDA: kernel breakdown (torch.profiler) of one eager stateful step per B rows x C frames")
    ap.add_argument("--stage-times", default="", metavar="B:C,...",
                    help="time and FLOP rate of each decoder stage in an eager stateful step per B rows x C frames "
                         "(`stage_times`; any device)")
    ap.add_argument("--gemm-max-rate-out", type=int, default=GEMM_MAX_RATE_OUT,
                    help="the decoder's stages up to this many output samples a frame run as GEMMs (`gemm_stage`; "
                         "40: up to 1 kHz), against the all-cuDNN decoder in the same run")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        assert torch.cuda.is_available(), "the benchmark needs a CUDA GPU (or --tiny --device cpu)"
        torch.backends.cuda.matmul.allow_tf32 = False  # fc2 in strict fp32 too (cuDNN: codec.precision)
        # cuDNN's plans picked within a served process's room, not the card's (engine/gpu_memory.py: a plan taken
        # with ~80 GB free on an H200 was wrong): the timings are those of the kernels a server runs
        bound_process_memory(device, HEADROOM_GB)
    batches = [int(b) for b in args.batches.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    result: dict[str, Any] = {"card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "python": platform.python_version(),
                              "preset": "tiny" if args.tiny else "full", "batches": batches, "rows": []}
    out_path = Path(args.out)

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    t0 = time.perf_counter()
    codec = random_codec(args.tiny, args.device)
    max_slots = max(*batches, 4)  # the parity section streams 4 utterances at once
    graphed, eager = (StreamingDecoder(codec, max_slots, gemm_max_rate_out=args.gemm_max_rate_out) for _ in range(2))
    # the same-call baseline: every stage on PyTorch's convolutions (cuDNN), none as GEMMs (`gemm_stage`)
    plain = StreamingDecoder(codec, max_slots, gemm=False)
    result["gemm_stages"], result["gemm_max_rate_out"] = graphed.gemm_stages, args.gemm_max_rate_out
    g = graphed.geometry
    result["geometry"] = {"hop": g.hop, "lookahead_samples": g.lookahead_samples,
                          "lookahead_frames": g.lookahead_frames, "receptive_field": g.receptive_field}
    result["state_bytes_per_stream"] = graphed.state_bytes_per_stream
    if device.type == "cuda":
        frame_buckets = sorted(set(steps) | {max(steps) + g.lookahead_frames})  # a final push needs the flush
        t1 = time.perf_counter()
        result["capture_check_rel"] = graphed.capture(batches, frame_buckets)
        result["capture_s"] = time.perf_counter() - t1
        result["graphed"] = graphed.graphed
        result["frame_buckets"] = frame_buckets
    decs = {"graphed": graphed, "eager": eager} if graphed.graphed else {"eager": eager}
    if args.profile and device.type == "cuda":
        result["profile"] = [profile_step(eager, *map(int, bc.split(":"))) for bc in args.profile.split(",")]
        for p in result["profile"]:
            log(f"profile B={p['batch']} C={p['frames']}: {p['kernels']} kernels {p['kernel_ms']:.2f} ms; top "
                + "; ".join(f"{k['ms']:.2f}ms x{k['count']} {k['name'][:60]}" for k in p["top"][:10]))
        save()
    if args.stage_times:
        result["stage_times"] = [dict(stage_times(dec, *map(int, bc.split(":")), device), decoder=name)
                                 for bc in args.stage_times.split(",")
                                 for name, dec in (("gemm", eager),
                                                   ("plain", StreamingDecoder(codec, max_slots, gemm=False)))]
        for st in result["stage_times"]:
            print_stage_times(st)
        save()
    log(f"{result['card']}: codec ready in {time.perf_counter() - t0:.1f} s; state "
        f"{graphed.state_bytes_per_stream} B/stream; graphs {graphed.graphed} "
        f"(check {result.get('capture_check_rel')})")

    result["parity"] = parity(codec, decs, [80, 57, 33, 101])
    log(f"parity: {result['parity']}")
    save()

    for b in batches:
        for s in steps:
            for name, dec in decs.items():
                result["rows"].append(stateful(dec, f"stateful_{name}", b, s, device))
                log(str(result["rows"][-1]))
                save()
        result["rows"].append(windowed(codec.decode, "windowed_eager", b, device))
        log(str(result["rows"][-1]))
        save()

    if device.type == "cuda":  # the baseline's graphs once the GEMM decoder's are gone (both do not fit the bound)
        decs.pop("graphed", None)
        del graphed
        torch.cuda.empty_cache()
        result["plain_capture_check_rel"] = plain.capture(batches, frame_buckets)
        if plain.graphed:
            result["parity_plain"] = parity(codec, {"plain_graphed": plain}, [80, 57, 33, 101])
            for b in batches:
                for s in steps:
                    result["rows"].append(stateful(plain, "stateful_plain_graphed", b, s, device))
                    log(str(result["rows"][-1]))
                    save()

    if device.type == "cuda":  # today's pipeline replays the window decode from graphs (stream/codec_graphs.py)
        del plain, decs
        torch.cuda.empty_cache()
        from higgs_stream.stream.codec_graphs import CodecGraphs

        window = 2 * WINDOW_CONTEXT + WINDOW_NEW
        cg = CodecGraphs(codec, [(b, window) for b in batches])
        result["windowed_graph_check_abs"] = cg.capture()
        for b in batches:
            result["rows"].append(windowed(cg.decode, "windowed_graphed", b, device))
            log(str(result["rows"][-1]))
            save()
        del cg
        torch.cuda.empty_cache()

    for b in batches:
        result["rows"].append(one_shot(codec, b, device))
        log(str(result["rows"][-1]))
        save()
    if device.type == "cuda" and not args.no_tf32:
        result["tf32"] = tf32_mode(codec, batches, max(steps), device)
        result["rows"] += result["tf32"].pop("rows")
        log(f"tf32: {result['tf32']}")
        save()
    if device.type == "cuda":
        result["max_memory_allocated_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
    save()
    summarize(result)
    return 0


def tf32_mode(codec: Codec, batches: list[int], step: int, device: torch.device) -> dict:
    """The opt-in TF32 codec (`serve --codec-precision tf32`): stateful and one-shot decode with
    cuDNN's TF32 convolutions, their error against the exact fp32 one-shot decode, and their speed."""

    def exact(codes: torch.Tensor) -> torch.Tensor:
        codec.allow_tf32 = False
        try:
            return codec.decode(codes)
        finally:
            codec.allow_tf32 = True

    codec.allow_tf32 = True
    try:
        dec = StreamingDecoder(codec, max(*batches, 4))
        check = dec.capture(batches, [step, step + dec.geometry.lookahead_frames])
        out: dict[str, Any] = {"capture_check_rel": check, "graphed": dec.graphed}
        out["parity_vs_exact"] = parity(codec, {"tf32": dec}, [80, 57, 33, 101], reference=exact)
        gen = torch.Generator().manual_seed(2)
        codes = torch.randint(0, 1024, (2, 8, 120), generator=gen)
        want = exact(codes)
        out["one_shot_max_rel_err"] = float((codec.decode(codes) - want).abs().max() / want.abs().max())
        rows = [stateful(dec, "stateful_tf32", b, step, device) for b in batches]
        rows += [dict(one_shot(codec, b, device), kind="one_shot_tf32") for b in batches]
        out["rows"] = rows
        return out
    finally:
        codec.allow_tf32 = False


def print_stage_times(st: dict) -> None:
    print(f"\n{st.get('decoder', '')} stateful step B={st['batch']} x C={st['frames']}: {st['step_ms']:.2f} ms, "
          f"{st['gflop']:.1f} GFLOP, {st['tflops']:.2f} TFLOP/s; the stages {st['stages_ms']:.2f} ms, "
          f"the rest {st['rest_ms']:.2f} ms")
    print(f"{'stage':>5} {'kind':<6} {'Cin':>5} {'Cout':>5} {'Hz':>6} {'ms':>8} {'GFLOP':>8} {'TFLOP/s':>8}")
    for r in st["stages"]:
        print(f"{r['stage']:>5} {r['kind']:<6} {r['in_channels']:>5} {r['out_channels']:>5} {r['rate_hz']:>6.0f} "
              f"{r['ms']:>8.3f} {r['gflop']:>8.3f} {r['tflops']:>8.3f}")


def summarize(r: dict) -> None:
    print(f"\n{r['card']} ({r['preset']} codec): frames/s (25 frames = 1 audio s); "
          f"state {r['state_bytes_per_stream']} B/stream")
    print(f"{'kind':<18} {'frames/call':>11} " + " ".join(f"{'B=' + str(b):>12}" for b in r["batches"]))
    keys = sorted({(row["kind"], row["frames_per_call"]) for row in r["rows"]}, key=lambda k: (k[0], -k[1]))
    for kind, frames in keys:
        cells = []
        for b in r["batches"]:
            row = next((x for x in r["rows"] if (x["kind"], x["frames_per_call"], x["batch"]) == (kind, frames, b)),
                       None)
            cells.append("—" if row is None else row["error"] if "error" in row else f"{row['frames_per_s']:.0f}")
        print(f"{kind:<18} {frames:>11} " + " ".join(f"{c:>12}" for c in cells))
    p = r["parity"]
    print("stateful vs one-shot, max |d| / peak: " +
          ", ".join(f"{k[:-len('_max_rel_err')]} {v:.2e}" for k, v in p.items() if k.endswith("_max_rel_err")))


if __name__ == "__main__":
    raise SystemExit(main())
