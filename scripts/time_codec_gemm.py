"""Each stage of the Higgs decoder's stateful step timed on cuDNN and as im2col + one GEMM (engine/codec/gemm_conv.py),
to find the stages where the GEMM wins (engine/codec/streaming.gemm_stage). One command on a GPU:

    python scripts/time_codec_gemm.py --out gemm.json [--batch 128 --frames 25]

Full-size codec, random weights, strict fp32 (no TF32 anywhere). Per stage: the input buffer of a B x C-frame step,
`_advance` on cuDNN, the same outputs with the stage's convolutions as GEMMs (a transposed conv's k = 2s form; a
residual unit's k7 conv through its im2col, skipped where that matrix would pass 2 GB), their max |d| / peak. Prints a
line a stage, writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from higgs_stream.bench.measure import device_seconds
from higgs_stream.engine.codec import StreamingDecoder
from higgs_stream.engine.codec.convs import codec_convs
from higgs_stream.engine.codec.streaming import _advance
from higgs_stream.engine.random_weights import random_full_codec

IM2COL_LIMIT = 2 << 30  # bytes


def timed_ms(fn, iters: int = 10) -> float:
    """Median device milliseconds of a call after one untimed call."""
    fn()
    return 1e3 * device_seconds(fn, iters)


def as_gemm(stage, buf: torch.Tensor, n: int) -> torch.Tensor | None:
    """`_advance` with `gemm` (None: a residual unit whose im2col would pass IM2COL_LIMIT)."""
    c = stage.module.conv1 if stage.kind == "res" else None
    if c is not None and buf.shape[0] * n * c.in_channels * c.kernel_size[0] * 4 > IM2COL_LIMIT:
        return None
    return _advance(stage, buf, n, gemm=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--frames", type=int, default=25)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    dec = StreamingDecoder(random_full_codec(seed=0), 4)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    with torch.no_grad(), codec_convs(dev, allow_tf32=False, cudnn=True):
        for i, st in enumerate(dec.stages):
            n = args.frames * st.rate_in
            buf = torch.randn((args.batch, st.channels, st.history + n), device=dev, generator=gen) * 0.5
            want = _advance(st, buf, n)
            row = {"stage": i, "kind": st.kind, "channels": st.channels, "rate_hz": st.rate_out * 25,
                   "cudnn_ms": timed_ms(lambda: _advance(st, buf, n))}
            got = as_gemm(st, buf, n)
            if got is not None:
                row["gemm_ms"] = timed_ms(lambda: as_gemm(st, buf, n))
                row["rel"] = float((got - want).abs().max() / want.abs().max())
            del got, want, buf
            torch.cuda.empty_cache()
            rows.append(row)
            print(f"stage {i:>2} {st.kind:<6} C={st.channels:>4} {row['rate_hz']:>6} Hz: cuDNN {row['cudnn_ms']:.3f} ms"
                  + (f", GEMM {row['gemm_ms']:.3f} ms (x{row['cudnn_ms'] / row['gemm_ms']:.2f}, rel {row['rel']:.1e})"
                     if "gemm_ms" in row else ", GEMM skipped (im2col > 2 GB)"), flush=True)
    Path(args.out).write_text(json.dumps({"card": torch.cuda.get_device_name(dev), "batch": args.batch,
                                          "frames": args.frames, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
