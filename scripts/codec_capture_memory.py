"""Device script (one GPU): GPU memory of the codec worker's warm-up, bucket by bucket: the stateful decoder's CUDA
graphs as `CodecWorker.capture` records them (same buckets, same slot count as a server of `--max-streams`), with
torch's allocator figures after each graph, and which buckets' replays differ from their eager steps.

    python scripts/codec_capture_memory.py --model CHECKPOINT_DIR | --random-v2 [--max-streams 256]
        [--headroom-gb GB] [--memory-fraction F] [--no-cudnn] [--deterministic] [--out mem.json]
    python scripts/codec_capture_memory.py ... --probe out.pt [--probe-buckets 16x2,64x25]
    python scripts/codec_capture_memory.py compare a.pt b.pt ...

`--probe`: no capture; eager steps at each (streams x frames) bucket (fresh, then from state) and one-shot decodes of
fixed codes, every convolution checked against PyTorch's native one (printed when off by > 1e-4 of peak or with
> 8 GB reserved), saved for `compare` across processes run with different settings. Why: a served Qwen3-TTS 1.7B ran
out of GPU memory in this warm-up on an H200 (110 GB in graph pools) and one cuDNN plan it ran there was wrong
(session 18, engine/gpu_memory.py)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import higgs_stream.engine.codec.step_graphs as step_graphs
from higgs_stream.engine.gpu_memory import bound_process_memory
from higgs_stream.engine.graph_capture import capture_buckets
from higgs_stream.engine.models.registry import load_codec_for
from higgs_stream.stream.codec_worker import CODEC_BATCH_BUCKETS, CODEC_STATE_SLOTS_MIN, frame_buckets
from higgs_stream.stream.chunking import AdapterConfig

GB = 1e9


LAST = [0.0]


def snapshot(label: str, quiet: bool = False) -> dict:
    """Allocator figures now; printed unless `quiet` and reserved memory grew by less than 1 GB."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    row = {"at": label, "allocated_gb": torch.cuda.memory_allocated() / GB,
           "reserved_gb": torch.cuda.memory_reserved() / GB, "used_gb": (total - free) / GB}
    if not quiet or row["reserved_gb"] - LAST[0] >= 1.0:
        print(" ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    LAST[0] = row["reserved_gb"]
    return row


def probe(codec, dec, path: str, buckets: list[tuple[int, int]]) -> None:
    """Eager stateful steps (each bucket's streams x frames, twice: fresh, then from state) and one-shot decodes of fixed
    random codes, saved to `path` with the peak reserved memory: compare the files of processes run with different
    settings (memory cap, cuDNN off)."""
    import torch.nn.functional as F

    found = {}

    def checking(name, fn):
        def run(x, weight, bias=None, *args, **kwargs):  # each convolution vs PyTorch's native one
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            y = fn(x, weight, bias, *args, **kwargs)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_reserved() / GB
            with torch.backends.cudnn.flags(enabled=False):
                ref = fn(x, weight, bias, *args, **kwargs)
            d = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            key = f"{name} x{tuple(x.shape)} w{tuple(weight.shape)} {args} {kwargs}"
            if d > 1e-4 or peak > 8:
                found[key] = (round(d, 4), round(peak, 1))
            return y
        return run

    F.conv1d = checking("conv1d", F.conv1d)
    F.conv_transpose1d = checking("conv_transpose1d", F.conv_transpose1d)
    g = torch.Generator().manual_seed(0)
    q, size = codec.geometry.num_codebooks, codec.geometry.codebook_size
    out = {}
    with torch.no_grad():
        dec.capture(sorted({b for b, _ in buckets}), sorted({c for _, c in buckets}), graphs=False)
        for b, c in buckets:
            slots = [dec.open() for _ in range(b)]
            for i in range(2):
                codes = torch.randint(0, size, (b, q, c), generator=g)
                torch.cuda.reset_peak_memory_stats()
                out[f"step{b}x{c}_{i}"] = dec.step(slots, codes, [c] * b, [False] * b).audio.float().cpu()
                out[f"step{b}x{c}_{i}_peak_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
            for slot in slots:
                dec.close(slot)
        for b, f in ((16, 2), (1, 50), (4, 25)):
            codes = torch.randint(0, size, (b, q, f), generator=g)
            torch.cuda.reset_peak_memory_stats()
            out[f"decode{b}x{f}"] = codec.decode(codes).float().cpu()
            out[f"decode{b}x{f}_peak_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
    print("convolutions off the native result by > 1e-4 of peak or with > 8 GB reserved (max |d| / peak, GB):")
    for k, v in found.items():
        print(" ", k, v)
    torch.save(out, path)
    print({k: round(v, 2) for k, v in out.items() if k.endswith("_gb")})


def compare(paths: list[str]) -> None:
    """Max |d| / peak of every probe tensor of each file against the first file's."""
    base = torch.load(paths[0])
    for p in paths[1:]:
        other = torch.load(p)
        print(p, {k: f"{float((other[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)):.3g}"
                  for k, v in base.items() if isinstance(v, torch.Tensor)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a checkpoint directory (its family's codec)")
    ap.add_argument("--random-v2", action="store_true", help="instead: the full-size Higgs codec, random weights")
    ap.add_argument("--headroom-gb", type=float, default=None,
                    help="cap the process as the server does (engine/gpu_memory.py) before anything runs")
    ap.add_argument("--probe-buckets", default="16x2", help="the probe's (streams x frames) steps")
    ap.add_argument("--max-streams", type=int, default=256)
    ap.add_argument("--deterministic", action="store_true", help="cuDNN's deterministic algorithms only")
    ap.add_argument("--no-cudnn", action="store_true", help="PyTorch's native convolutions instead of cuDNN's")
    ap.add_argument("--memory-fraction", type=float, default=None, help="cap this process's GPU memory (an H100's share)")
    ap.add_argument("--probe", default=None, help="no capture: save eager steps' and one-shot decodes' audio here (.pt)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cudnn.deterministic = args.deterministic
    torch.backends.cudnn.enabled = not args.no_cudnn
    if args.memory_fraction:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    print(f"CUDNN_CONV_WSCAP_DBG={os.environ.get('CUDNN_CONV_WSCAP_DBG')} deterministic={args.deterministic} "
          f"cudnn={not args.no_cudnn} memory_fraction={args.memory_fraction}")
    rows = [snapshot("start")]
    if args.random_v2:
        from higgs_stream.engine.random_weights import random_full_codec

        codec = random_full_codec(0)
    else:
        codec = load_codec_for(args.model, device="cuda")
    rows.append(snapshot("codec loaded"))
    if args.headroom_gb:
        print("cap:", bound_process_memory("cuda", args.headroom_gb))
    slots = max(CODEC_STATE_SLOTS_MIN, 2 * args.max_streams)  # as CodecWorker sizes its arena
    dec = codec.streaming_decoder(slots)
    rows.append(snapshot(f"arena of {slots} slots ({dec.state_bytes_per_stream / 1e6:.2f} MB a stream)"))
    frames = frame_buckets(codec.geometry, AdapterConfig().schedule[-1])
    if args.probe:
        probe(codec, dec, args.probe, [tuple(map(int, b.split("x"))) for b in args.probe_buckets.split(",")])
        return

    def logged(keys, stage, body, device=None, stream=None):  # capture_buckets, one graph at a time, measured
        graphs, outputs = {}, {}
        pool = torch.cuda.graph_pool_handle()
        for key in sorted(keys, reverse=True):
            t0 = time.perf_counter()
            g, o = capture_buckets([key], stage, body, device, stream, pool=pool)
            graphs.update(g)
            outputs.update(o)
            rows.append(snapshot(f"graph {key} ({time.perf_counter() - t0:.2f} s)", quiet=True))
        return graphs, outputs

    step_graphs.capture_buckets = logged
    check = dec._check_graph
    bad = {}

    def checked(key, graph, output):  # each bucket's replay-vs-eager check; the ones above 1e-5 of peak kept
        diff = check(key, graph, output)
        if diff > 1e-5:
            bad[str(key)] = diff
        return diff

    dec._check_graph = checked
    with torch.no_grad():
        diff = dec.capture(CODEC_BATCH_BUCKETS, frames)
    rows.append(snapshot(f"captured {len(frames) * len(CODEC_BATCH_BUCKETS)} buckets, check {diff:.3g}"))
    print("buckets whose replay differs from the eager step by > 1e-5 of peak:", bad or "none")
    print("replay ms:", {str(k): round(v * 1e3, 2) for k, v in dec.timings.items() if k in ((1, 1), (16, 2), (64, 1), (64, 25))})
    torch.cuda.empty_cache()
    rows.append(snapshot("after empty_cache"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(), "model": args.model, "bad_checks": bad,
                       "replay_ms": {str(k): v * 1e3 for k, v in dec.timings.items()}, "cudnn": not args.no_cudnn,
                       "memory_fraction": args.memory_fraction,
                       "wscap_mb": os.environ.get("CUDNN_CONV_WSCAP_DBG"), "deterministic": args.deterministic, "frames": list(frames),
                       "batches": list(CODEC_BATCH_BUCKETS), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["compare"]:
        compare(sys.argv[2:])
    else:
        main()
