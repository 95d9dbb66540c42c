"""The top functions of each thread in a sampled profile (`serve --profile-out FILE`): by innermost function
("leaf": where the thread's time went; a C call such as a device wait is counted at the Python function
that made it) and by every function on the stack ("cum"), as shares of the thread's samples and as seconds
(samples x interval).

    python scripts/top_samples.py profile.json [--top 20] [--threads higgs-engine,higgs-codec,MainThread]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--threads", default="higgs-engine,higgs-codec,MainThread",
                    help="comma-separated thread names ('all': every thread)")
    args = ap.parse_args()
    prof = json.load(open(args.path))
    dt = prof["interval_s"]
    print(f"{args.path}: {prof['samples']} samples every {1e3 * dt:.1f} ms over {prof['wall_s']:.1f} s")
    wanted = None if args.threads == "all" else args.threads.split(",")
    for name, th in prof["threads"].items():
        if wanted is not None and name not in wanted:
            continue
        n = th["samples"]
        for kind in ("leaf", "cum"):
            print(f"  {name} ({n} samples) by {kind}:")
            rows = [(k, c) for k, c in th[kind] if kind == "leaf" or c < n]  # cum: not the frames under every sample
            for key, count in rows[: args.top]:
                print(f"    {100 * count / n:5.1f}%  {count * dt:7.2f} s  {key[:120]}")


if __name__ == "__main__":
    main()
