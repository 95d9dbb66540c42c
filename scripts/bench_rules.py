"""The decode step's sample-and-advance alone on a GPU: the served form (eager torch ops captured in a CUDA graph)
against the same body with the family's row rules fused by torch.compile (`DeviceStreamState(fuse_rules=True)`), both
replayed from CUDA graphs; kernel counts from an eager profile; equality of the packed rows and of every state
field over a run of steps. An experiment for issue #14's one-row step (session 22's profile: ~130 launches of
indexing and rules, ~170 us of a 1.8 ms step). Usage: python scripts/bench_rules.py [--arch v2|v3] [--rows 1,16,256]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from higgs_stream.engine.gpu_sampling import DeviceStreamState, StreamStart
from higgs_stream.engine.request import SamplingParams

K_V2, CB = 8, 1024
FIELDS = ("last_col", "ncols", "num_delay", "num_remaining", "stop_reason", "done", "window", "win_pos", "win_fill")


def rules_for(arch: str, k: int):
    if arch == "v3":
        from higgs_stream.engine.models.higgs_v3.device_rules import V3DeviceRules
        return V3DeviceRules(k)
    from higgs_stream.engine.models.higgs_v2.device_rules import V2DeviceRules
    return V2DeviceRules()


def make_state(rows: int, arch: str, k: int, device: str, fused: bool) -> DeviceStreamState:
    st = DeviceStreamState(rows, 8, k, CB, device, rules=rules_for(arch, k), fuse_rules=fused)
    rng = np.random.default_rng(0)
    st.start([StreamStart(i, SamplingParams(temperature=0.0 if i % 4 == 0 else 0.8, top_k=[None, 50][i % 2],
                                            top_p=[1.0, 0.9][i % 2], ras_window=[0, 7][i % 2], ras_max_repeat=2,
                                            seed=2**40 + i), 200, rng.integers(0, CB, (k, 5))) for i in range(rows)])
    return st


def graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def replay_us(g: torch.cuda.CUDAGraph, n: int = 2000) -> float:
    for _ in range(50):
        g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def kernels(fn) -> tuple[int, float]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return len(ev), sum(e.device_time for e in ev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="v2")
    ap.add_argument("--rows", default="1,2,16,64,256")
    ap.add_argument("--steps", type=int, default=40, help="steps compared for equality")
    ap.add_argument("--out", default="")
    ap.add_argument("--device", default="cuda", help="cpu: the equality check alone (no graphs, no profile)")
    a = ap.parse_args()
    k = K_V2
    results = []
    for rows in [int(r) for r in a.rows.split(",")]:
        gen = torch.Generator(device=a.device).manual_seed(rows)
        logits = torch.randn(rows, k, CB + 2, device=a.device, generator=gen) * 3
        slots = torch.arange(rows, device=a.device)
        valid = torch.ones(rows, dtype=torch.bool, device=a.device)
        t0 = time.perf_counter()
        ref, fused = make_state(rows, a.arch, k, a.device, False), make_state(rows, a.arch, k, a.device, True)
        compile_s = time.perf_counter() - t0  # the fused state's compiles (RowRules.fuse), a warm cache after the first
        step_ref = lambda: ref.sample_and_advance(logits, slots, valid)  # noqa: E731
        step_fused = lambda: fused.sample_and_advance(logits, slots, valid)  # noqa: E731
        # equality, eager, step by step (same logits; the rows ramp in, repeat, reach the cap and stop)
        worst = 0
        for i in range(a.steps):
            logits.copy_(torch.randn(rows, k, CB + 2, device=a.device, generator=gen) * 3)
            pa, pb = step_ref(), step_fused()
            worst += int((pa != pb).sum())
            for f in FIELDS:
                worst += int((getattr(ref, f) != getattr(fused, f)).sum())
        if a.device == "cpu":
            print(json.dumps(dict(rows=rows, mismatches=worst, compile_s=round(compile_s, 1))), flush=True)
            continue
        n_ref, us_ref = kernels(step_ref)
        n_fused, us_fused = kernels(step_fused)
        g_ref, _ = graph(step_ref)
        g_fused, _ = graph(step_fused)
        r_ref, r_fused = [], []
        for _ in range(3):  # alternate
            r_ref.append(replay_us(g_ref))
            r_fused.append(replay_us(g_fused))
        row = dict(rows=rows, arch=a.arch, mismatches=worst, steps_compared=a.steps, compile_s=round(compile_s, 1),
                   kernels_served=n_ref, kernels_fused=n_fused, kernel_us_served=round(us_ref, 1),
                   kernel_us_fused=round(us_fused, 1), replay_us_served=[round(x, 1) for x in r_ref],
                   replay_us_fused=[round(x, 1) for x in r_fused])
        results.append(row)
        print(json.dumps(row), flush=True)
    print(f"{'rows':>5} {'kernels':>9} {'kernel us':>13} {'replay us (median)':>20}  mismatches")
    for r in results:
        print(f"{r['rows']:>5} {r['kernels_served']:>4}/{r['kernels_fused']:<4} {r['kernel_us_served']:>6}/"
              f"{r['kernel_us_fused']:<6} {np.median(r['replay_us_served']):>9.1f}/{np.median(r['replay_us_fused']):<9.1f}"
              f"  {r['mismatches']}")
    if a.out:
        json.dump({"card": torch.cuda.get_device_name(), "results": results}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
