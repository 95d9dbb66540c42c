"""The CUDA-core GEMV choice's start-up cost on an empty Triton cache (engine/gemv_choice.py `measure` over a model's
plain linear shapes): its compiles run ahead side by side (`compile_ahead`, the default) against one after another
(the timing compiling each variant as it goes), each run in a fresh process with its own empty TRITON_CACHE_DIR, the
arms alternating. Prints a table, writes DIR/cold_start_gemv.json.

    python scripts/cold_start_gemv.py --out DIR [--linears v2,qwen3-1.7b] [--rows 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ARMS = ("ahead", "serial")


def child(arm: str, linears: str, rows: int) -> dict:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sweep_gemv import LINEARS

    from higgs_stream.engine import gemv_choice as gc

    if arm == "serial":
        gc.compile_ahead = lambda *args, **kwargs: None  # the timing compiles each variant as it goes
    weights = [torch.empty(shape, dtype=torch.bfloat16, device="meta") for shape in LINEARS[linears]().values()]
    torch.cuda.init()
    start = time.perf_counter()
    choice = gc.measure(weights, rows, torch.bfloat16, torch.device("cuda"))
    return {"arm": arm, "linears": linears, "rows": rows, "s": time.perf_counter() - start,
            "shapes": len(gc.plain_shapes(weights)), "cpus": os.cpu_count(), **choice.describe()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--linears", default="v2,qwen3-1.7b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("ARM", "LINEARS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.rows)))
        return
    results = []
    for r in range(args.rounds):
        for linears in args.linears.split(","):
            for arm in ARMS:
                with tempfile.TemporaryDirectory(prefix="triton_cold_") as cache:
                    env = {**os.environ, "TRITON_CACHE_DIR": cache}
                    proc = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--child", arm, linears],
                                          env=env, capture_output=True, text=True)
                if proc.returncode:
                    print(f"{linears} {arm}: failed\n{proc.stderr[-2000:]}", flush=True)
                    continue
                res = {**json.loads(proc.stdout.strip().splitlines()[-1]), "round": r + 1}
                results.append(res)
                print(f"round {r + 1} {linears:12s} {arm:7s} {res['s']:6.1f} s  ({res['shapes']} shapes x "
                      f"{args.rows} rows, {res['cpus']} CPUs; GEMV for {res['gemv_shapes']})", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cold_start_gemv.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
