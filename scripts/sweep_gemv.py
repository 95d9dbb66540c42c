"""Device script (one H100/H200): the small-batch linears of a full-size talker (v2 by default) quantized or plain,
and the Triton kernels' block sizes for them.

    python scripts/sweep_gemv.py --out DIR [--weights fp8,int8,bf16] [--linears v2|v3|qwen3-1.7b|qwen3-0.6b]
        [--batches 1,16] [--gemv-only] [--w8a8-batches 64,256]

For each weight dtype, linear (N, K) and M: bf16 cuBLAS; the quantized linear's tensor-core path ("served": what
`--quantize` runs from 3 rows; `fp8_linear`: weight-only in the Triton kernel at its `gemv_blocks` up to 16 rows,
`int8_linear`: the Triton kernel at `block_sizes(M)`); for fp8 also the w8a8 path (per-token quantization + torch's
scaled GEMM, what fp8 runs above 16 rows); then the Triton kernel at every block configuration of a grid (not with
`--gemv-only`), and up to 4 rows the CUDA-core GEMV (`triton_gemv`, served for 1-2 rows) at every configuration of its
own grid. `--weights bf16`: the plain bf16 weight (scale 1) through the same Triton kernels, against cuBLAS
(`F.linear`, what is served) and cuBLAS given the operands swapped (`W @ x^T`, transposed back: other tiles).
`--linears`: v2's or v3's four layer linears, or a Qwen3-TTS size's talker and code-predictor linears (keys `talker.*`,
`cp.*`: the predictor's projection from the talker, its layer's four, its head). `--w8a8-batches`: torch's scaled
GEMM vs the Triton kernel's fp8 tiles (`triton_scaled_linear`) at several
promotion intervals, with each one's error against the exact product. Each timing is 24 calls in one CUDA graph over
enough weight copies to exceed the L2 cache (every call reads its weight from HBM, as a decode step does). Also each
way's max error against the fp32 product, relative to its peak. Writes DIR/gemv_sweep.json and prints the table and,
per M, the one configuration best summed over a decode layer's four linears (and the GEMV's best blocks, as
`bench_quant --gemv-blocks` takes them). Sessions 9, 14 and 15 (H100): docs/bench/fp8_gemv_sweep_h100.json,
docs/bench/s15_h100.json.gz, docs/PERF.md."""

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
from higgs_stream.engine.models.higgs_v3.config import TalkerV3Config
from higgs_stream.engine.models.qwen3_tts.config import preset
from higgs_stream.engine.quantize import quantize_weight
from higgs_stream.kernels.fp8_linear import _scaled_gemm, fp8_linear, quantize_per_token
from higgs_stream.kernels.int8_linear import GEMV_ROWS_MAX, int8_linear, triton_gemv, triton_linear, triton_scaled_linear

L2_BYTES = 64 << 20
CALLS = 24
GRID = list(itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 5)))  # BN, BK, warps, stages
GEMV_GRID = list(itertools.product((8, 16, 32), (512, 1024, 2048), (4,), (3,)))  # triton_gemv: BN, BK, warps, stages
# --gemv-grid wide: warps and pipeline stages too (81 configurations; session 22, a card other than the H100)
GEMV_GRID_WIDE = list(itertools.product((8, 16, 32), (512, 1024, 2048), (2, 4, 8), (2, 3, 4)))


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

# BM, BN, BK, warps, stages (the best of session 15's first sweep) x how often the fp8 MMA's sums are promoted into
# fp32 along K (0: never, Triton's default on Hopper; torch's scaled GEMM runs cuBLAS's precise mode)
W8A8_TILES = ((64, 64, 128, 8, 4), (64, 64, 128, 4, 4), (64, 128, 128, 8, 4), (64, 128, 128, 4, 4),
              (128, 64, 128, 8, 4), (128, 128, 128, 8, 4), (128, 256, 128, 8, 4), (64, 256, 128, 8, 3))
W8A8_GRID = list(itertools.product(W8A8_TILES, (0, 128)))


def qwen3_linears(size: str) -> dict[str, tuple[int, int]]:
    """A Qwen3-TTS size's linears (N, K) as the fast path fuses them: the talker's layer and head, the code
    predictor's input projection (1.7B), layer and head (fp32 out, timed here in bf16)."""
    c = preset(size)
    out = {}
    for pre, d in (("talker", c), ("cp", c.code_predictor)):
        q = d.num_heads * d.head_dim
        out.update({f"{pre}.qkv": ((d.num_heads + 2 * d.num_kv_heads) * d.head_dim, d.hidden_size),
                    f"{pre}.o": (d.hidden_size, q), f"{pre}.gate_up": (2 * d.intermediate_size, d.hidden_size),
                    f"{pre}.down": (d.hidden_size, d.intermediate_size)})
    out["talker.head"] = (c.vocab_size, c.hidden_size)
    if c.hidden_size != c.code_predictor.hidden_size:
        out["cp.proj"] = (c.code_predictor.hidden_size, c.hidden_size)
    out["cp.head"] = (c.codebook_size, c.code_predictor.hidden_size)
    return out


def v3_linears() -> dict[str, tuple[int, int]]:
    """Higgs v3's layer linears (N, K), fused as the fast path reads them."""
    c = TalkerV3Config.full()
    return {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
            "o": (c.hidden_size, c.num_heads * c.head_dim), "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size)}


LINEARS = {"v2": lambda: V2_LINEARS, "v3": v3_linears, "qwen3-1.7b": lambda: qwen3_linears("1.7b"),
           "qwen3-0.6b": lambda: qwen3_linears("0.6b")}


class Bf16Weight:
    """A plain bf16 weight as the quantized linears' kernels take one: itself, no scale (the tensor-core kernel's:
    ones, exact)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.qweight, self.scale = w, None
        self.tc_scale = torch.ones(w.shape[0], dtype=torch.float32, device=w.device)


def served(mode: str):
    """The linear `--quantize mode` runs (bf16: cuBLAS)."""
    return {"fp8": fp8_linear, "int8": int8_linear}.get(mode, lambda x, w, _s: F.linear(x, w))


def tc_scale(q) -> torch.Tensor:
    """The tensor-core kernel's scales for a weight of the sweep (a plain one: ones)."""
    return q.tc_scale if isinstance(q, Bf16Weight) else q.scale


def swapped(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T as cuBLAS computes (w @ x^T)^T: the problem transposed, so its heuristics see M = N (one row: the
    result's transpose is already contiguous)."""
    return torch.mm(w, x.t()).t().contiguous()


def sweep_one(mode: str, name: str, n: int, k: int, batches: list[int], tensor_core_grid: bool = True,
              gemv_grid: list = GEMV_GRID) -> list[dict]:
    copies = max(2, -(-2 * L2_BYTES // (n * k)))  # 8-bit bytes per copy: n * k
    # bf16 copies: distinct ones enough to exceed the L2 (each twice the 8-bit bytes)
    ws = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(max(2, copies // 2))]
    qs = [Bf16Weight(ws[i % len(ws)]) if mode == "bf16" else quantize_weight(ws[i % len(ws)], mode)
          for i in range(copies)]
    rows = []
    for m in batches:
        x = torch.randn(m, k, device="cuda").bfloat16()
        exact = x.float() @ ws[0].float().t()

        def err(y: torch.Tensor) -> float:
            return float((y.float() - exact).abs().max() / exact.abs().max())

        fn = served(mode)
        row = {"weights": mode, "linear": name, "n": n, "k": k, "m": m, "weight_copies": copies,
               "floor_us": n * k * (2 if mode == "bf16" else 1) / 3.0e6,  # at ~3 TB/s (an H100's copy bandwidth)
               "bf16_cublas": timed([lambda w=w: F.linear(x, w) for w in ws]),
               "served": timed([lambda q=q: fn(x, q.qweight, q.scale) for q in qs]),
               "err_served": err(fn(x, qs[0].qweight, qs[0].scale)), "err_bf16": err(F.linear(x, ws[0])), "grid": {}}
        if mode == "bf16":
            row["bf16_cublas_swapped"] = timed([lambda w=w: swapped(x, w) for w in ws])
        if mode == "fp8":
            row["w8a8_scaled_gemm"] = timed([lambda q=q: fp8_linear(x, q.qweight, q.scale, gemv_max_m=0) for q in qs])
            row["err_w8a8"] = err(fp8_linear(x, qs[0].qweight, qs[0].scale, gemv_max_m=0))
        for bn, bk, warps, stages in GRID if tensor_core_grid else ():
            cfg = (16, bn, bk, warps, stages)
            try:
                row["grid"][str(cfg)] = timed([lambda q=q, c=cfg: triton_linear(x, q.qweight, tc_scale(q), blocks=c)
                                               for q in qs])
            except Exception as exc:  # e.g. shared memory exceeded: say so, go on
                row["grid"][str(cfg)] = repr(exc)[:120]
        if m <= GEMV_ROWS_MAX:  # the CUDA-core GEMV, keyed "gemv (BN, BK, warps, stages)"
            for cfg in gemv_grid:
                try:
                    row["grid"][f"gemv {cfg}"] = timed([lambda q=q, c=cfg: triton_gemv(x, q.qweight, q.scale, blocks=c)
                                                        for q in qs])
                except Exception as exc:
                    row["grid"][f"gemv {cfg}"] = repr(exc)[:120]
            row["err_gemv"] = err(triton_gemv(x, qs[0].qweight, qs[0].scale))
        ok = {c: t for c, t in row["grid"].items() if isinstance(t, float)}
        row["best"] = [(c, ok[c]) for c in sorted(ok, key=ok.get)[:2]]
        rows.append(row)
        extra = (f"w8a8 {row['w8a8_scaled_gemm']:5.1f} | " if mode == "fp8" else
                 f"swapped {row['bf16_cublas_swapped']:5.1f} | " if mode == "bf16" else "")
        best = " ".join(f"{c} {t:5.1f}" for c, t in row["best"]) or "-"
        print(f"{mode} {name:12s} m={m:3d} floor {row['floor_us']:5.1f} us | bf16 {row['bf16_cublas']:5.1f} | "
              f"served {row['served']:5.1f} | {extra}best {best} | "
              f"err served {row['err_served']:.1e} bf16 {row['err_bf16']:.1e}", flush=True)
    return rows


def sweep_w8a8(name: str, n: int, k: int, batches: list[int]) -> list[dict]:
    """fp8 above the small batches: the GEMM of e4m3 activations (quantized per token) and weights, torch's scaled
    GEMM (cuBLASLt's choice of tiles) vs our Triton kernel's w8a8 form over W8A8_GRID."""
    copies = max(2, -(-2 * L2_BYTES // (n * k)))
    ws = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(min(copies, 3))]
    qs = [quantize_weight(ws[i % len(ws)], "fp8") for i in range(copies)]
    rows = []
    for m in batches:
        x = torch.randn(m, k, device="cuda").bfloat16()
        xq, xs = quantize_per_token(x)
        # the exact product of the quantized operands (fp32 sums of exact fp8 x fp8 products), before bf16 rounding
        want = (xq.float() @ qs[0].qweight.float().t()) * xs[:, None] * qs[0].scale[None, :]
        theirs = _scaled_gemm(xq, xs, qs[0].qweight, qs[0].scale, torch.bfloat16, False).float()
        row = {"linear": name, "n": n, "k": k, "m": m, "floor_us": n * k / 3.0e6,
               "err_scaled_mm": float((theirs - want).abs().max() / want.abs().max()),
               "scaled_mm": timed([lambda q=q: _scaled_gemm(xq, xs, q.qweight, q.scale, torch.bfloat16, False)
                                   for q in qs]), "grid": {}}
        # the operands swapped (W @ xq^T: N becomes cuBLASLt's M, other tiles), out [N, M]; and with the transpose
        # back to [M, N] the next kernel reads (one more launch)
        swap = torch._scaled_mm(qs[0].qweight, xq.t(), scale_a=qs[0].scale[:, None], scale_b=xs[None, :],
                                out_dtype=torch.bfloat16).float().t()
        row["err_scaled_mm_swapped"] = float((swap - want).abs().max() / want.abs().max())
        row["scaled_mm_swapped"] = timed([lambda q=q: torch._scaled_mm(
            q.qweight, xq.t(), scale_a=q.scale[:, None], scale_b=xs[None, :], out_dtype=torch.bfloat16) for q in qs])
        row["scaled_mm_swapped_t"] = timed([lambda q=q: torch._scaled_mm(
            q.qweight, xq.t(), scale_a=q.scale[:, None], scale_b=xs[None, :],
            out_dtype=torch.bfloat16).t().contiguous() for q in qs])
        row["scaled_mm_fast_accum"] = timed([lambda q=q: _scaled_gemm(xq, xs, q.qweight, q.scale, torch.bfloat16, True)
                                             for q in qs])
        row["max_rel_diff"] = {}  # per configuration: vs the exact product, relative to its peak
        for tile, every in W8A8_GRID:
            key = str((tile, every))
            try:
                got = triton_scaled_linear(xq, xs, qs[0].qweight, qs[0].scale, blocks=tile, acc_every=every).float()
                row["max_rel_diff"][key] = float((got - want).abs().max() / want.abs().max())
                row["grid"][key] = timed([lambda q=q, c=tile, e=every: triton_scaled_linear(
                    xq, xs, q.qweight, q.scale, blocks=c, acc_every=e) for q in qs])
            except Exception as exc:
                row["grid"][key] = repr(exc)[:120]
        ok = {c: t for c, t in row["grid"].items() if isinstance(t, float)}
        row["best"] = [(c, ok[c]) for c in sorted(ok, key=ok.get)[:2]]
        rows.append(row)
        best = " ".join(f"{c} {t:5.1f}" for c, t in row["best"]) or "-"
        print(f"w8a8 {name:8s} m={m:3d} floor {row['floor_us']:5.1f} us | scaled_mm {row['scaled_mm']:5.1f} "
              f"(err {row['err_scaled_mm']:.1e}) swapped {row['scaled_mm_swapped']:5.1f} / +t {row['scaled_mm_swapped_t']:5.1f} "
              f"fast {row['scaled_mm_fast_accum']:5.1f} | "
              f"best {best} | err of the best {row['max_rel_diff'].get(row['best'][0][0], float('nan')) if row['best'] else float('nan'):.1e}",
              flush=True)
    return rows


def layer_totals(per: list[dict]) -> tuple[dict[str, float], str | None]:
    """A decode layer's linears (`per`, one row each): every grid configuration that ran on all of them, its times
    summed; and the fastest of those (None: none ran everywhere)."""
    cfgs = [c for c in per[0]["grid"] if all(isinstance(r["grid"].get(c), float) for r in per)]
    tot = {c: sum(r["grid"][c] for r in per) for c in cfgs}
    return tot, (min(tot, key=tot.get) if tot else None)


def layer_summary(rows: list[dict]) -> dict:
    """Per (weights, linear group, M): the group's linears summed (v2: a decode layer's four; Qwen3-TTS: the talker's
    and the code predictor's, by their key's prefix), served vs the best single configuration and vs the best way
    of each linear (what a per-linear choice would run)."""
    out = {}
    group = lambda r: r["linear"].split(".")[0] if "." in r["linear"] else "layer"  # noqa: E731
    for mode, g, m in sorted({(r["weights"], group(r), r["m"]) for r in rows}):
        per = [r for r in rows if r["weights"] == mode and group(r) == g and r["m"] == m]
        tot, b = layer_totals(per)
        key = f"{mode} {g} m={m}" if g != "layer" else f"{mode} m={m}"
        each = {r["linear"]: min([(r["served"], "served"), (r.get("bf16_cublas_swapped", 1e9), "cublas swapped")]
                                 + [(t, c) for c, t in r["grid"].items() if isinstance(t, float)]) for r in per}
        out[key] = {"best_cfg": b, "best_layer_us": tot.get(b), "served_layer_us": sum(r["served"] for r in per),
                    "bf16_layer_us": sum(r["bf16_cublas"] for r in per),
                    "best_each_layer_us": sum(t for t, _ in each.values()), "best_each": each}
        if mode == "bf16":
            out[key]["swapped_layer_us"] = sum(r["bf16_cublas_swapped"] for r in per)
        gemv = {c: t for c, t in tot.items() if c.startswith("gemv ")}
        if gemv:  # the CUDA-core GEMV's best, as `bench_quant --gemv-blocks` takes it
            g = min(gemv, key=gemv.get)
            out[key].update(best_gemv_cfg=g, best_gemv_layer_us=gemv[g],
                            best_gemv_blocks=",".join(c.strip() for c in g[len("gemv ("):-1].split(",")))
        print(f"{key}: {len(per)} linears: bf16 {out[key]['bf16_layer_us']:.1f} us, served "
              f"{out[key]['served_layer_us']:.1f}" + (f", best single configuration {b} {tot[b]:.1f}" if tot else "")
              + (f", best GEMV {out[key]['best_gemv_cfg']} {out[key]['best_gemv_layer_us']:.1f}" if gemv else "")
              + f", best of each {out[key]['best_each_layer_us']:.1f}: "
              + "; ".join(f"{n} {c} {t:.1f}" for n, (t, c) in each.items()))
    return out


def w8a8_summary(rows: list[dict]) -> dict:
    """Per M: a decode layer's four w8a8 GEMMs, torch's scaled GEMM vs the best single Triton tiles (overall and per
    promotion interval) and the best tiles per linear."""
    out = {}
    for m in sorted({r["m"] for r in rows}):
        per = [r for r in rows if r["m"] == m]
        tot, b = layer_totals(per)
        best_each = sum(r["best"][0][1] for r in per if r["best"])
        by_acc = {e: min((t for c, t in tot.items() if c.endswith(f", {e})")), default=None) for e in (0, 128)}
        out[f"w8a8 m={m}"] = {"scaled_mm_layer_us": sum(r["scaled_mm"] for r in per), "best_cfg": b,
                              "swapped_layer_us": sum(r["scaled_mm_swapped"] for r in per),
                              "swapped_t_layer_us": sum(r["scaled_mm_swapped_t"] for r in per),
                              "best_of_plain_swapped_t_layer_us": sum(min(r["scaled_mm"], r["scaled_mm_swapped_t"])
                                                                      for r in per),
                              "best_layer_us": tot.get(b), "best_each_layer_us": best_each,
                              "best_layer_us_by_acc_every": by_acc}
        print(f"w8a8 m={m}: one layer's 4 GEMMs: scaled_mm {out[f'w8a8 m={m}']['scaled_mm_layer_us']:.1f} us "
              f"(swapped {out[f'w8a8 m={m}']['swapped_layer_us']:.1f}, +t {out[f'w8a8 m={m}']['swapped_t_layer_us']:.1f}, "
              f"best of plain / swapped+t per linear {out[f'w8a8 m={m}']['best_of_plain_swapped_t_layer_us']:.1f}), "
              f"best single tiles {b} {tot.get(b, float('nan')):.1f}, best per linear {best_each:.1f}; best single by "
              f"acc_every {by_acc}")
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--weights", default="fp8,int8", help="fp8, int8, bf16 (comma-separated)")
    ap.add_argument("--linears", choices=sorted(LINEARS), default="v2")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--w8a8-batches", default="", help="also the w8a8 GEMM sweep (sweep_w8a8) at these M (e.g. 64,256)")
    ap.add_argument("--gemv-only", action="store_true",
                    help="skip the tensor-core kernel's grid (the served ways and the CUDA-core GEMV's grid only)")
    ap.add_argument("--gemv-grid", choices=("narrow", "wide"), default="narrow",
                    help="the CUDA-core GEMV's grid: BN x BK at 4 warps, 3 stages (narrow); x warps 2/4/8 x stages "
                    "2/3/4 (wide)")
    args = ap.parse_args()
    gemv_grid = GEMV_GRID_WIDE if args.gemv_grid == "wide" else GEMV_GRID
    torch.manual_seed(0)
    t_start, rows = time.time(), []
    batches = [int(b) for b in args.batches.split(",") if b]
    linears = LINEARS[args.linears]()
    for mode in filter(None, args.weights.split(",")):
        for name, (n, k) in linears.items():
            rows += sweep_one(mode, name, n, k, batches, tensor_core_grid=not args.gemv_only, gemv_grid=gemv_grid)
    summary = layer_summary(rows) if rows else {}
    w8a8 = []
    for m in [int(b) for b in args.w8a8_batches.split(",") if b]:
        for name, (n, k) in linears.items():
            w8a8 += sweep_w8a8(name, n, k, [m])
    summary.update(w8a8_summary(w8a8))
    dev = torch.cuda.get_device_name()
    with open(os.path.join(args.out, "gemv_sweep.json"), "w") as f:
        json.dump({"device": dev, "rows": rows, "w8a8": w8a8, "summary": summary, "seconds": time.time() - t_start},
                  f, indent=1)
    print(f"{dev}: done in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
