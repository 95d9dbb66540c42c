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
import time
from pathlib import Path
from typing import Any

import torch

from higgs_stream.bench.codec import codec_timings, codec_variants
from higgs_stream.bench.decode import (
    copy_bandwidth,
    decode_profiles,
    decode_sweep,
    record_floor,
    transformers_baseline,
)
from higgs_stream.bench.measure import log
from higgs_stream.bench.model import engine_config, random_v2, v2_engine
from higgs_stream.bench.parity import eager_batch1, greedy_batch_parity
from higgs_stream.bench.stream import ab_variants, stream_bench
from higgs_stream.bench_model import batch_vs_single, logprob_parity
from higgs_stream.engine.engine import Engine
from higgs_stream.engine.models.registry import DEFAULT_ARCH, FAMILIES
from higgs_stream.engine.random_weights import (
    in_memory_engine,
    random_full_codec,
    suppress_eos,
)



def gemv_choices(engine) -> dict:
    """What engine/gemv_choice.py timed and chose at load: for the talker's layers and (Qwen3-TTS) its code
    predictor's, each shape and row count's cuBLAS and GEMV times, and the shapes the GEMV serves."""
    choices = engine.runner.gemv_choices()
    for name, c in choices.items():
        for line in c.report():
            log(f"{name}: {line}")
    return {name: {**c.describe(), "timings": list(c.timings)} for name, c in choices.items()}

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
    ap.add_argument("--pdl-max-rows", type=int, default=None, metavar="N",
                    help="CUDA 9.0+: decode graphs of at most N rows with programmatic dependent launch (default: the "
                         "talker's, engine.model_runner.default_pdl_max_rows; 0: never)")
    ap.add_argument("--bf16-gemv-rows", type=int, default=None, metavar="N",
                    help="plain bf16 linears of at most N rows on the CUDA-core GEMV where it beats cuBLAS (default: "
                         "ModelRunnerConfig.bf16_gemv_rows; 0: never)")
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

    config = engine_config(args.kv_pages)
    runner_options = {key: getattr(args, key) for key in ("pdl_max_rows", "bf16_gemv_rows")
                      if getattr(args, key) is not None}
    result.update(quantize=args.quantize, arch=args.arch, runner_options=runner_options)
    if args.arch != DEFAULT_ARCH:  # the family's random model, drawn in memory, EOS suppressed
        result["preset"] = args.preset
        t0 = time.perf_counter()
        engine = in_memory_engine(args.arch, args.preset, "cuda", torch.bfloat16, config,
                                  cuda_graphs=not args.no_graphs, quantize=args.quantize, runner_options=runner_options)
        result["build_and_capture_s"] = time.perf_counter() - t0
        result["bf16_gemv"] = gemv_choices(engine)
        return _other_arch(engine, result, args, bw, save)
    tok, cfg, hf, talker = random_v2(args.quantize)
    engine, result["graph_capture_s"] = v2_engine(talker, cfg, tok, config, cuda_graphs=not args.no_graphs,
                                                  quantize=args.quantize, runner_options=runner_options)
    weight_bytes = record_floor(engine, result, bw)
    result["bf16_gemv"] = gemv_choices(engine)
    log(f"engine ready (capture {result['graph_capture_s']:.1f} s); audio step reads {weight_bytes/1e9:.2f} GB "
        f"-> floor {weight_bytes/bw*1e3:.3f} ms")
    save()

    if "parity" in sections:  # against the reference's whole audio head: before EOS is suppressed
        result["logprob_parity"] = logprob_parity(hf, engine)
        log(f"logprob parity: {result['logprob_parity']}")
    suppress_eos(engine)  # from here on every stream runs to its frame cap (top-k requests: TOP_K or less)
    if "parity" in sections:
        eager = eager_batch1(engine, talker, cfg, tok)
        result["greedy_batch_parity"] = greedy_batch_parity(engine, eager, ras_window=0)
        result["greedy_batch_parity_ras"] = greedy_batch_parity(engine, eager, ras_window=7)
        result["batch_vs_single_logits"] = batch_vs_single(engine, eager)
        log(f"teacher-forced batched (graph) vs batch-1 (eager) logits: {result['batch_vs_single_logits']}")
        result["batch_vs_single_logits_batched_prefill"] = batch_vs_single(engine, eager, batched_prefill=True)
        log(f"... with the prompts prefilled together: {result['batch_vs_single_logits_batched_prefill']}")
        log(f"greedy batched (graphs) vs eager batch-1: {result['greedy_batch_parity']}")
        del eager
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
        result["profile"] = decode_profiles(engine)
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
    weight_bytes = record_floor(engine, result, bw)
    log(f"{args.arch} {args.preset} ready in {result['build_and_capture_s']:.1f} s; a decode step reads "
        f"{weight_bytes/1e9:.2f} GB -> floor {weight_bytes/bw*1e3:.3f} ms")
    save()
    if "profile" in args.sections.split(",") and engine.runner.graphs is not None:
        result["profile"] = decode_profiles(engine)
        save()
    if "decode" in args.sections.split(",") and engine.runner.graphs is not None:
        result["decode"] = decode_sweep(engine, [int(b) for b in args.batches.split(",")], args.context,
                                        weight_bytes, bw)
    summarize(result)
    save()
    return 0


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
