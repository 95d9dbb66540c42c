"""The fused codec layers (kernels/codec_layers.py) timed against the stages they replace, on a GPU (one command):

    python scripts/sweep_codec_layers.py --out sweep.json [--batch 128 --frames 25]

Full-size Higgs v2 decoder, random weights: for each stage `engine/codec/streaming.fused_stage` takes (the first conv,
the residual units of <= 64 channels, the last conv), a B x C-frame step's input buffer timed through PyTorch's
convolutions (`_advance`, cuDNN, strict fp32) and through the fused kernel; for the residual units also every block of
positions (32-256) and warp count (2-8) in IEEE fp32, and TF32 / 3xTF32 products, each with its max |d| / peak vs
cuDNN fp32. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from higgs_stream.engine.codec import StreamingDecoder
from higgs_stream.engine.codec.convs import codec_convs
from higgs_stream.engine.codec.streaming import _advance, fused_stage
from higgs_stream.engine.random_weights import random_full_codec
from higgs_stream.kernels import codec_layers as cl


def timed_ms(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--frames", type=int, default=25)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    codec = random_full_codec(seed=0)
    dec = StreamingDecoder(codec, 4)
    rows, seen = [], set()
    gen = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad(), codec_convs(dev, allow_tf32=False, cudnn=True):
        for i, st in enumerate(dec.stages):
            fast = fused_stage(st)
            if fast is None:
                continue
            n = args.frames * st.rate_in
            key = (st.kind, st.channels, st.rate_in, getattr(getattr(st.module, "conv1", None), "dilation", None))
            if key in seen:
                continue
            seen.add(key)
            buf = torch.randn((args.batch, st.channels, st.history + n), device=dev, generator=gen) * 0.5
            want = _advance(st, buf, n)
            peak = float(want.abs().max())
            row = {"stage": i, "kind": st.kind, "channels": st.channels, "rate_hz": st.rate_in * 25,
                   "dilation": key[3][0] if key[3] else 1, "cudnn_ms": timed_ms(lambda: _advance(st, buf, n)),
                   "fused_ms": timed_ms(lambda: fast(buf, n, "ieee")),
                   "fused_rel": float((fast(buf, n, "ieee") - want).abs().max()) / peak, "variants": []}
            if st.kind == "res":
                m = st.module
                wts = cl.ResidualUnitWeights(m.snake1.alpha, m.conv1.weight, m.conv1.bias, m.conv1.dilation[0],
                                             m.snake2.alpha, m.conv2.weight, m.conv2.bias)
                for prec in cl.PRECISIONS:
                    for bt in (32, 64, 128, 256):
                        for warps in (2, 4, 8):
                            if prec != "ieee" and warps == 2:
                                continue
                            if st.channels * bt > 16384:
                                continue
                            try:
                                ms = timed_ms(lambda: cl.residual_unit(buf, wts, precision=prec, block_t=bt,
                                                                       num_warps=warps))
                                err = float((cl.residual_unit(buf, wts, precision=prec, block_t=bt, num_warps=warps)
                                             - want).abs().max()) / peak
                            except Exception as e:  # a configuration that does not compile (registers, shared memory)
                                row["variants"].append({"precision": prec, "block_t": bt, "warps": warps,
                                                        "error": repr(e)[:200]})
                                continue
                            row["variants"].append({"precision": prec, "block_t": bt, "warps": warps, "ms": ms,
                                                    "rel": err})
            rows.append(row)
            best = min((v for v in row["variants"] if v.get("precision") == "ieee" and "ms" in v),
                       key=lambda v: v["ms"], default=None)
            print(f"stage {i:>2} {st.kind:<5} C={st.channels:>4} {row['rate_hz']:>6} Hz d={row['dilation']}: "
                  f"cuDNN {row['cudnn_ms']:.3f} ms, fused {row['fused_ms']:.3f} ms (x{row['cudnn_ms'] / row['fused_ms']:.2f}, "
                  f"rel {row['fused_rel']:.2e})"
                  + (f"; best ieee BT={best['block_t']} w={best['warps']} {best['ms']:.3f} ms" if best else "")
                  + "".join(f"; {p} best {min(v['ms'] for v in row['variants'] if v.get('precision') == p and 'ms' in v):.3f} ms"
                            f" rel {max(v['rel'] for v in row['variants'] if v.get('precision') == p and 'ms' in v):.1e}"
                            for p in ("tf32", "tf32x3") if any(v.get('precision') == p and 'ms' in v for v in row['variants'])),
                  flush=True)
    Path(args.out).write_text(json.dumps({"card": torch.cuda.get_device_name(dev), "batch": args.batch,
                                          "frames": args.frames, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
