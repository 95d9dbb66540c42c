"""The GIL convoy behind the engine steps with unexplained host time (docs/PERF.md, session 8), on any CPU.

An engine step makes a dozen or more calls that drop the GIL and take it back (torch ops, attention
planning, the graph replay, event records, copies). While another thread of the process runs pure
Python (the event loop writing to sockets, the codec thread planning a call), each retake waits until
that thread is made to let go: up to one switch interval per call. This script times a step of N tiny
torch calls (each drops the GIL) beside a thread that runs pure Python in 20 ms bursts, at several
switch intervals; the latency of a hand-off through a queue when the sender keeps running Python for
0.7 ms (the engine queues a round for the codec thread and goes on routing; the codec thread hands audio
to the event loop; the event loop wakes the engine: a stream's first audio crosses three); and the
throughput of two pure-Python threads at the same intervals (what a shorter interval costs).

    python scripts/gil_convoy.py [--calls 12] [--out gil_convoy.json]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time

import torch

INTERVALS_MS = (5.0, 1.0, 0.5, 0.2, 0.1)


def python_burst(stop: threading.Event, burst_s: float, idle_s: float, work: list[int]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < burst_s:
            sum(i * i for i in range(200))  # pure Python: holds the GIL
            work[0] += 1
        time.sleep(idle_s)


def step_times(calls: int, steps: int, busy: bool) -> list[float]:
    x = torch.zeros(8)
    stop, work = threading.Event(), [0]
    th = threading.Thread(target=python_burst, args=(stop, 0.02, 0.005, work)) if busy else None
    if th is not None:
        th.start()
        time.sleep(0.05)
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        for _ in range(calls):
            x.add_(1.0)  # the binding drops the GIL around the op and takes it back
        out.append(time.perf_counter() - t)
        time.sleep(0.002)  # the device wait between steps
    stop.set()
    if th is not None:
        th.join()
    return out


def handoff_times(n: int = 300, sender_python_s: float = 0.0007) -> list[float]:
    """Seconds from a queue put to the receiver running, while the sender runs Python after the put."""
    q: queue.Queue[float | None] = queue.Queue()
    lat: list[float] = []

    def receive() -> None:
        while (t := q.get()) is not None:
            lat.append(time.perf_counter() - t)

    th = threading.Thread(target=receive)
    th.start()
    for _ in range(n):
        q.put(time.perf_counter())
        t = time.perf_counter()
        while time.perf_counter() - t < sender_python_s:
            sum(i * i for i in range(50))
        time.sleep(0.003)
    q.put(None)
    th.join()
    return sorted(lat)


def two_threads_work(seconds: float = 2.0) -> float:
    stop, counts = threading.Event(), [[0], [0]]
    ths = [threading.Thread(target=python_burst, args=(stop, 1.0, 0.0, c)) for c in counts]
    for th in ths:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in ths:
        th.join()
    return sum(c[0] for c in counts) / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=12, help="GIL-dropping calls per step")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    before, rows = sys.getswitchinterval(), []
    try:
        for ms in INTERVALS_MS:
            sys.setswitchinterval(ms / 1e3)
            alone = sorted(step_times(args.calls, 50, busy=False))
            beside = sorted(step_times(args.calls, args.steps, busy=True))
            q = lambda xs, p: 1e3 * xs[min(len(xs) - 1, int(p * len(xs)))]
            hand = handoff_times()
            rows.append({"switch_ms": ms, "alone_p50_ms": 1e3 * statistics.median(alone),
                         "beside_p50_ms": q(beside, 0.5), "beside_p90_ms": q(beside, 0.9),
                         "beside_p99_ms": q(beside, 0.99), "handoff_p50_ms": q(hand, 0.5),
                         "handoff_p90_ms": q(hand, 0.9), "two_threads_work_per_s": two_threads_work()})
    finally:
        sys.setswitchinterval(before)
    print(f"a step of {args.calls} GIL-dropping torch calls, alone and beside a thread running pure Python in 20 ms bursts")
    print(f"{'switch ms':>9} {'alone p50':>10} {'beside p50':>11} {'p90':>7} {'p99':>7} {'hand-off p50':>13} {'p90':>6} "
          f"{'2 Python threads work/s':>24}")
    for r in rows:
        print(f"{r['switch_ms']:>9.1f} {r['alone_p50_ms']:>10.2f} {r['beside_p50_ms']:>11.2f} {r['beside_p90_ms']:>7.2f} "
              f"{r['beside_p99_ms']:>7.2f} {r['handoff_p50_ms']:>13.2f} {r['handoff_p90_ms']:>6.2f} "
              f"{r['two_threads_work_per_s']:>24.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"calls": args.calls, "python": sys.version.split()[0], "torch": torch.__version__, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
