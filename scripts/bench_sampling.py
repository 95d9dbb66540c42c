"""Device script (one GPU): the fused draw (kernels/sample_rows.py) with its thresholds from one sort of each row vs
by bisection over the scores' keys, at the shapes the engines sample: Higgs v2's 8 heads of 1,026 ids, the Qwen3-TTS
code predictor's 2,048 and its talker head's 3,072, rows 1-256; default sampling (top-p 0.95, no top-k, temperature
0.7) and with top-k 50. Each timing is CALLS draws in one CUDA graph. Also how many tokens the two forms draw
differently (rows the reference leaves to rounding aside, tests/kernels/conftest.py `ambiguous`).

    python scripts/bench_sampling.py [--rows 1,16,64,128,256] [--out sampling.json]

Prints one line per case and writes the JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from higgs_stream.bench.measure import device_seconds, log
from higgs_stream.kernels.sample_rows import sample_rows, sample_rows_ref

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from conftest import ambiguous  # noqa: E402

CALLS = 20
SHAPES = (("v2 heads", 8, 1026), ("qwen predictor", 1, 2048), ("qwen talker", 1, 3072))


def timed(fn) -> float:
    """Microseconds per call: CALLS calls in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    return device_seconds(graph.replay, 7) / CALLS * 1e6


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
                toks = {}
                for form, bisect in (("sort", False), ("bisect", True)):
                    row[f"{form}_us"] = timed(lambda bisect=bisect: sample_rows(logits, noise, **p, clean=False,
                                                                               bisect=bisect))
                    toks[form] = sample_rows(logits, noise, **p, clean=False, bisect=bisect)[0]
                want, _ = sample_rows_ref(logits, noise, **p, clean=False)
                skip = ambiguous(logits, noise, p)
                row["compared"] = int((~skip).sum())
                row["differ_sort"] = int(((toks["sort"] != want) & ~skip).sum())
                row["differ_bisect"] = int(((toks["bisect"] != want) & ~skip).sum())
                row["speedup"] = row["sort_us"] / row["bisect_us"]
                rows_out.append(row)
                log(f"sample {name} rows={b} top_k={top_k}: sort {row['sort_us']:.1f} us, bisect "
                    f"{row['bisect_us']:.1f} us ({row['speedup']:.2f}x); differ from ref sort {row['differ_sort']} "
                    f"bisect {row['differ_bisect']} of {row['compared']}")
    card = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump({"card": card, "calls_per_graph": CALLS, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
