"""Device script (one GPU): paged decode attention as the engine's CUDA graphs run it (`GraphDecodeAttention`):
FlashInfer's CUDA-core decode kernel, its tensor-core decode (`use_tensor_cores`) and our Triton kernel
(kernels/paged_decode.py, whole or ranged) at each (block_n, warps, stages) of `--triton`, over bf16 and fp8 (e4m3) K/V pages, at
several batch sizes and contexts; v2's shapes by default (24 query heads, 8 K/V heads, head 128, pages of 16, 28
layers).

    python scripts/bench_attention.py [--batches 1,64,256] [--contexts 300] [--triton 64x4x1,64x4x1r,...] [--out attn.json]

Each timing is one CUDA graph of `layers` calls, one per layer's own K/V pool (as a decode step reads
them: from HBM, not L2), replayed; the floor is the K/V bytes read at the copy bandwidth measured in the
same run. Each other kernel's output is compared with the CUDA-core one on the same pages (max |d| relative
to the output's peak)."""

from __future__ import annotations

import argparse
import json
import re

import torch

from higgs_stream.bench.decode import copy_bandwidth
from higgs_stream.bench.measure import device_seconds, log
from higgs_stream.engine.graph_capture import capture_buckets
from higgs_stream.kernels.flashinfer_attention import WORKSPACE_BYTES, GraphDecodeAttention, HostCSR

FP8 = torch.float8_e4m3fn


def pools(layers: int, pages: int, page: int, hkv: int, d: int, dtype: torch.dtype) -> list[tuple]:
    out = []
    for _ in range(layers):
        k = torch.randn(pages, page, hkv, d, device="cuda")
        v = torch.randn(pages, page, hkv, d, device="cuda")
        out.append((k.to(dtype), v.to(dtype)))
    return out


def triton_spec(spec: str) -> tuple[str, dict]:
    """'64x4x1' -> ("triton", paged_decode's block_n, num_warps, num_stages): the whole form; then 'c': e4m3 pages cast
    to bf16 (`fp8_words=False`, the form before session 21) instead of read as words; then 'r': its ranged form
    ("triton_ranges") with decode_splits' programs for the batch, 'rN': with N programs (e.g. '64x4x1r4', '64x4x1cr')."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)(c)?(r(\d+)?)?", spec)
    if m is None:
        raise ValueError(f"bad Triton spec {spec!r}: expected BLOCKxWARPSxSTAGES[c][r[N]]")
    block_n, warps, stages, cast, ranged, programs = m.groups()
    params = {"block_n": int(block_n), "num_warps": int(warps), "num_stages": int(stages),
              **({"programs": int(programs)} if programs else {}), **({"fp8_words": False} if cast else {})}
    return ("triton_ranges" if ranged else "triton"), params


def one(batch: int, context: int, kv_dtype: torch.dtype, kernel: str, params: str | None,
        kv: list[tuple], q: torch.Tensor, args, workspace: torch.Tensor) -> tuple[float, torch.Tensor]:
    ps = args.page_size
    per = -(-context // ps)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]  # disjoint pages per sequence
    csr = HostCSR.build(tables, [context] * batch, [1] * batch, ps)
    extra = {}
    if params:
        kernel, extra["triton_params"] = triton_spec(params)
        if kernel == "triton_ranges":
            extra["max_kv_len"] = args.max_kv_len
    attn = GraphDecodeAttention(batch, batch * per + batch, args.q_heads, args.kv_heads, args.head_dim, ps,
                                torch.device("cuda"), workspace, torch.bfloat16, kv_dtype, kernel=kernel, **extra)
    attn.plan(csr)
    # the engine's capture helper: two warm-up runs on a side stream (JIT compiles), then the graph
    graphs, outputs = capture_buckets((batch,), lambda b: None, lambda b: [attn.run(q, k, v) for k, v in kv])
    graph = graphs[batch]
    graph.replay()
    torch.cuda.synchronize()
    seconds = device_seconds(graph.replay, 10)
    out = outputs[batch][0].float()  # layer 0's output of the last replay
    del graph, graphs
    return seconds, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--contexts", default="300")
    ap.add_argument("--triton", default="64x4x1,64x4x1r", help="the Triton kernel's block_n x warps x stages, whole, "
                    "or + 'r' its ranged form (decode_splits' programs; 'rN': N), comma-separated")
    ap.add_argument("--max-kv-len", type=int, default=4096 + 64, help="the ranged form's longest sequence (its slots)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--q-heads", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    triton = [t for t in args.triton.split(",") if t]
    kernels = [("cuda_cores", None), ("tensor_cores", None)] + [("triton", t) for t in triton]
    pages = max(b * -(-c // args.page_size) + b for b in batches for c in contexts)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    rows = []
    for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("fp8", FP8)):
        kv = pools(args.layers, pages, args.page_size, args.kv_heads, args.head_dim, kv_dtype)
        esize = torch.empty((), dtype=kv_dtype).element_size()
        for context in contexts:
            for b in batches:
                if b * -(-context // args.page_size) + b > pages:
                    continue
                q = torch.randn(b, args.q_heads, args.head_dim, device="cuda").bfloat16()
                kv_bytes = args.layers * 2 * b * context * args.kv_heads * args.head_dim * esize
                ref = None
                for kernel, params in kernels:
                    row = {"kv": kv_name, "batch": b, "context": context, "kernel": kernel, "params": params,
                           "floor_us_per_layer": kv_bytes / bw / args.layers * 1e6}
                    try:
                        s, out = one(b, context, kv_dtype, kernel, params, kv, q, args, workspace)
                        row["us_per_layer"] = s / args.layers * 1e6
                        row["bandwidth_share"] = row["floor_us_per_layer"] / row["us_per_layer"]
                        if ref is None:
                            ref = out
                        else:
                            row["max_rel_diff_vs_cuda_cores"] = float((out - ref).abs().max() / ref.abs().max())
                    except Exception as exc:  # a combination a library does not build: say so, go on
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
                    log(f"attn kv={kv_name} ctx={context} b={b} {kernel}{params or ''}: " + ", ".join(
                        f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                        if k not in ("kv", "batch", "kernel", "context", "params")))
        del kv
        torch.cuda.empty_cache()
    result = {"card": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bw / 1e9, "shapes": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
