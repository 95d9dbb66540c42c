"""The top functions of a thread profile (`serve --profile-out PREFIX`: PREFIX.engine.pstats,
PREFIX.codec.pstats), by own time and by cumulative time, each as a share of the thread's profiled time.

    python scripts/top_pstats.py run.engine.pstats [--top 25] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pstats


def rows(path: str) -> tuple[float, list[dict]]:
    """(total own seconds, one row per function: name, calls, own s, cumulative s)."""
    st = pstats.Stats(path).stats
    out = [{"function": f"{name} ({'/'.join(file.rsplit('/', 2)[-2:])}:{line})",
            "calls": v[1], "own_s": v[2], "cum_s": v[3]} for (file, line, name), v in st.items()]
    return sum(r["own_s"] for r in out), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    total, rs = rows(args.path)
    report = {"total_own_s": total}
    for key in ("own_s", "cum_s"):
        top = sorted(rs, key=lambda r: -r[key])[: args.top]
        report[f"by_{key}"] = top
        print(f"{args.path}: top {args.top} by {key} (thread total {total:.2f} s)")
        for r in top:
            print(f"  {100 * r[key] / total:6.1f}%  {r[key]:8.3f} s  {r['calls']:>9}  {r['function'][:110]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
