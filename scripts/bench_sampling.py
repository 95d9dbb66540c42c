"""Device script (one GPU): the fused draw (kernels/sample_rows.py) at the shapes the engines sample: Higgs v2's 8
heads of 1,026 ids, the Qwen3-TTS code predictor's 2,048 and its talker head's 3,072, rows 1-256; default sampling
(top-p 0.95, no top-k, temperature 0.7) and with top-k 50. Each timing is CALLS draws in one CUDA graph. Also how
many tokens differ from the plain-torch reference (rows it leaves to rounding aside, tests/kernels/conftest.py
`ambiguous`). Session 14 (H100) timed the sorting kernel before it against the bisecting one: docs/PERF.md.

    python scripts/bench_sampling.py [--rows 1,16,64,128,256] [--out sampling.json]

Prints one line per case and writes the JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from higgs_stream.bench.measure import log
from higgs_stream.bench_quant import graph_time
from higgs_stream.kernels.sample_rows import sample_rows, sample_rows_ref

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from conftest import ambiguous  # noqa: E402

CALLS = 20
SHAPES = (("v2 heads", 8, 1026), ("qwen predictor", 1, 2048), ("qwen talker", 1, 3072))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64,128,256")
    ap.add_argument("--out", default="sampling.json")
    args = ap.parse_args()
    rows_out = []
    for name, heads, vocab in SHAPES:
        for b in [int(x) for x in args.rows.split(",")]:
            for top_k in (None, 50):
                g = torch.Generator(device="cuda").manual_seed(b * 7 + vocab)
                logits = torch.randn(b, heads, vocab, device="cuda", generator=g) * 3
                noise = torch.empty(b, heads, vocab, device="cuda").exponential_(generator=g)
                p = {"temperature": torch.full((b,), 0.7, device="cuda"),
                     "top_k": torch.full((b,), top_k or vocab, dtype=torch.long, device="cuda"),
                     "top_p_cut": torch.full((b,), 0.05, device="cuda"),
                     "greedy": torch.zeros(b, dtype=torch.bool, device="cuda")}
                row = {"shape": name, "heads": heads, "vocab": vocab, "rows": b, "top_k": top_k}
                row["kernel_us"] = graph_time(lambda: sample_rows(logits, noise, **p, clean=False), CALLS, 7) * 1e6
                got = sample_rows(logits, noise, **p, clean=False)[0]
                want, _ = sample_rows_ref(logits, noise, **p, clean=False)
                skip = ambiguous(logits, noise, p)
                row["compared"] = int((~skip).sum())
                row["differ"] = int(((got != want) & ~skip).sum())
                rows_out.append(row)
                log(f"sample {name} rows={b} top_k={top_k}: {row['kernel_us']:.1f} us; differ from ref "
                    f"{row['differ']} of {row['compared']}")
    card = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump({"card": card, "calls_per_graph": CALLS, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
