"""Device script (one H100/H200): fp8 small-batch linears of the full-size v2 talker, three ways, and the
Triton kernel's block sizes for the weight-only one.

    python scripts/sweep_fp8_gemv.py --out DIR

For each v2 linear (N, K) and M in 1, 16: bf16 cuBLAS; `fp8_linear` as it runs now (activations
quantized per token, then e4m3 x e4m3 in the Triton kernel: two launches); the same kernel on bf16
activations and e4m3 weights widened in registers (weight-only: one launch), at the default blocks and at
every block configuration of a grid. Each timing is 24 calls in one CUDA graph over enough weight copies
to exceed the L2 cache (every call reads its weight from HBM, as a decode step does). Also each way's
error against the fp32 product. Writes DIR/fp8_gemv.json and prints the table."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from higgs_stream.bench.measure import device_seconds
from higgs_stream.bench_quant import V2_LINEARS
from higgs_stream.engine.quantize import quantize_weight
from higgs_stream.kernels.fp8_linear import fp8_linear
from higgs_stream.kernels.int8_linear import block_sizes, triton_linear

L2_BYTES = 64 << 20
CALLS = 24
GRID = list(itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 5)))  # BN, BK, warps, stages


def timed(fns: list) -> float:
    """Microseconds per call: CALLS calls cycling over `fns` (one per weight copy) in one CUDA graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fns[i % len(fns)]()
    graph.replay()
    us = device_seconds(graph.replay, 5) / CALLS * 1e6
    del graph
    return us


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows, t_start = [], time.time()
    for name, (n, k) in V2_LINEARS.items():
        copies = max(2, -(-2 * L2_BYTES // (n * k)))  # fp8 bytes per copy: n * k
        ws = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(min(copies, 3))]
        qs = [quantize_weight(ws[i % len(ws)], "fp8") for i in range(copies)]
        for m in [int(b) for b in args.batches.split(",")]:
            x = torch.randn(m, k, device="cuda").bfloat16()
            exact = x.float() @ ws[0].float().t()
            def err(y: torch.Tensor) -> float:
                return float((y.float() - exact).abs().max() / exact.abs().max())
            row = {"linear": name, "n": n, "k": k, "m": m, "weight_copies": copies,
                   "floor_us_fp8": n * k / 3.0e6,  # at ~3 TB/s (an H100's copy bandwidth)
                   "bf16_cublas": timed([lambda w=w: F.linear(x, w) for w in ws]),
                   "w8a8_now": timed([lambda q=q: fp8_linear(x, q.qweight, q.scale) for q in qs]),
                   "weight_only_default": timed([lambda q=q: triton_linear(x, q.qweight, q.scale) for q in qs]),
                   "err_w8a8": err(fp8_linear(x, qs[0].qweight, qs[0].scale)),
                   "err_weight_only": err(triton_linear(x, qs[0].qweight, qs[0].scale)),
                   "err_bf16": err(F.linear(x, ws[0])), "default_blocks": block_sizes(m), "grid": {}}
            for bn, bk, warps, stages in GRID:
                cfg = (16, bn, bk, warps, stages)
                try:
                    row["grid"][str(cfg)] = timed([lambda q=q, c=cfg: triton_linear(x, q.qweight, q.scale, blocks=c)
                                                   for q in qs])
                except Exception as exc:  # e.g. shared memory exceeded: say so, go on
                    row["grid"][str(cfg)] = repr(exc)[:120]
            ok = {c: t for c, t in row["grid"].items() if isinstance(t, float)}
            best = sorted(ok, key=ok.get)[:3]
            row["best"] = [(c, ok[c]) for c in best]
            rows.append(row)
            print(f"{name:8s} m={m:3d} floor {row['floor_us_fp8']:5.1f} us | bf16 {row['bf16_cublas']:5.1f} | "
                  f"w8a8 now {row['w8a8_now']:5.1f} | weight-only default {row['weight_only_default']:5.1f} | "
                  f"best {best[0]} {ok[best[0]]:5.1f} ({best[1]} {ok[best[1]]:5.1f}) | "
                  f"err w8a8 {row['err_w8a8']:.1e} wo {row['err_weight_only']:.1e} bf16 {row['err_bf16']:.1e}",
                  flush=True)
    # the one configuration best summed over the linears of a decode layer, per M
    summary = {}
    for m in sorted({r["m"] for r in rows}):
        per = [r for r in rows if r["m"] == m]
        cfgs = [c for c in per[0]["grid"] if all(isinstance(r["grid"].get(c), float) for r in per)]
        tot = {c: sum(r["grid"][c] for r in per) for c in cfgs}
        b = min(tot, key=tot.get)
        summary[m] = {"best_cfg": b, "layer_us": tot[b], "default_layer_us": sum(r["weight_only_default"] for r in per),
                      "w8a8_now_layer_us": sum(r["w8a8_now"] for r in per), "bf16_layer_us": sum(r["bf16_cublas"] for r in per)}
        print(f"m={m}: one layer's 4 linears: bf16 {summary[m]['bf16_layer_us']:.1f} us, w8a8 now "
              f"{summary[m]['w8a8_now_layer_us']:.1f}, weight-only default {summary[m]['default_layer_us']:.1f}, "
              f"weight-only {b} {tot[b]:.1f}")
    dev = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "fp8_gemv.json"), "w") as f:
        json.dump({"device": dev, "rows": rows, "summary": summary, "seconds": time.time() - t_start}, f, indent=1)
    print(f"{dev}: done in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
