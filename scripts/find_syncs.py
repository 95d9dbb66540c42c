"""Device script: where the engine's steps make the host wait for the device outside its own event waits.

Runs a random full-size model's engine (CUDA graphs, fast kernels) through whole requests (admission,
prefill, decode, end, release) under torch's sync debug mode, which warns at every synchronizing CUDA call
(blocking copies, `.item()`, `torch.cuda.synchronize`; not `Event.synchronize`, the engine's deliberate
waits), and prints each Python call site with its count.

    python scripts/find_syncs.py [--arch v2|v3|qwen3-tts] [--preset 1.7b] [--requests 6]
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch
from higgs_stream.engine.engine import EngineConfig
from higgs_stream.engine.random_weights import in_memory_engine
from higgs_stream.engine.request import GenerationRequest, SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog."


def run(engine, n: int, seed0: int, frames: int) -> None:
    for i in range(n):
        engine.add(GenerationRequest(TEXT, sampling=SamplingParams(seed=seed0 + i), max_frames=frames + 3 * i))
    while engine.has_work():
        engine.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="v2")
    ap.add_argument("--preset", default="full")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--frames", type=int, default=24)
    args = ap.parse_args()
    engine = in_memory_engine(args.arch, args.preset, "cuda", torch.bfloat16, EngineConfig(kv_pages=2048, max_batch=16),
                              cuda_graphs=True, kernels="fast")
    run(engine, args.requests, 0, args.frames)  # warm-up: compilation, graphs, allocator
    torch.cuda.synchronize()
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):  # e.g. the mode's own "prototype feature" notice
            return
        stack = [f for f in traceback.extract_stack()[:-1] if "higgs_stream" in f.filename or "flashinfer" in f.filename]
        where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in reversed(stack[-3:]))
        sites[where or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(engine, args.requests, 100, args.frames)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"{args.arch} {args.preset}: {sum(sites.values())} synchronizing calls in {args.requests} requests")
    for where, count in sites.most_common():
        print(f"  {count:6d}  {where}")


if __name__ == "__main__":
    main()
