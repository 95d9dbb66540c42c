"""Where a lone stream's first engine steps go (the prompt's prefill step first): wall time of each of
its first steps, then a torch.profiler table of the prefill step, and on CUDA the number of kernels
(graph replays included) and their device time in the prefill step and in a decode step of one
stream, on a random model drawn in memory.

    python scripts/profile_first_step.py --arch qwen3-tts --preset 1.7b [--device cuda] [--out prof.txt]

The engine is warmed up with whole utterances first (kernel compilation, graph capture, allocator),
so the numbers are those of a warm server's next request."""

from __future__ import annotations

import argparse
import time

import torch
from higgs_stream.bench.measure import kernel_time, report, sync
from higgs_stream.engine.engine import EngineConfig
from higgs_stream.engine.random_weights import in_memory_engine
from higgs_stream.engine.request import GenerationRequest, SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest."


def one_request(engine, seed: int, steps: int, device: str) -> list[float]:
    """Wall ms of each of the first `steps` engine steps of one lone request (events read each step)."""
    engine.add(GenerationRequest(TEXT, sampling=SamplingParams(seed=seed), max_frames=steps + 4))
    times = []
    for _ in range(steps):
        sync(torch.device(device))
        t0 = time.perf_counter()
        engine.step()
        sync(torch.device(device))
        times.append(1e3 * (time.perf_counter() - t0))
    while engine.has_work():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3-tts")
    ap.add_argument("--preset", default="1.7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the profiler tables here too")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    engine = in_memory_engine(args.arch, args.preset, args.device, torch.bfloat16 if cuda else torch.float32,
                              EngineConfig(kv_pages=512, max_batch=8), cuda_graphs=cuda,
                              kernels="fast" if cuda else "ref")
    for seed in range(2):  # warm-up
        one_request(engine, seed, args.steps, args.device)
    for seed in range(2, 5):
        print(f"{args.arch} {args.preset}: first {args.steps} steps of a lone request (ms): "
              + " ".join(f"{t:.2f}" for t in one_request(engine, seed, args.steps, args.device)))
    engine.add(GenerationRequest(TEXT, sampling=SamplingParams(seed=9), max_frames=8))
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    profiled = []
    for _ in range(3):  # the prefill step, then (after one step in between) a decode step
        with torch.profiler.profile(activities=acts) as prof:
            engine.step()
            sync(torch.device(args.device))
        profiled.append(prof)
    while engine.has_work():
        engine.step()
    prof = profiled[0]
    tables = [prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)]
    if cuda:
        tables.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        for name, p in (("prefill step", profiled[0]), ("decode step", profiled[2])):
            kernels, device_ms = kernel_time(p)
            print(f"{args.arch} {args.preset}: {name}: {kernels} kernels, {device_ms:.2f} ms of device time")
    report("\n\n".join(tables), args.out)


if __name__ == "__main__":
    main()
