"""Load generator: a real WebSocket client of a running server, measuring what a listener hears.

    python -m higgs_stream.loadgen --url ws://127.0.0.1:8000/v1/tts/stream \\
        --open-rates 1,5,10,20 --closed 16,64,128,256,512 --duration 20 --out lg.json --plot lg.png
    python -m higgs_stream.loadgen --spawn "higgs-stream serve --model random:full --max-frames 250" ...
    python -m higgs_stream.loadgen --plot-from lg_v2.json lg_v3.json --plot lg.png

Scenarios, one after another (one context = one utterance per request, PROTOCOL.md §1):
  open@R    open loop: Poisson arrivals at R req/s for --duration s (times drawn up front from
            --seed); each request starts at its scheduled time whatever the server does, on an
            idle connection of the process's pool (or a new one)
  closed@N  closed loop: N workers, each on its own connection, send a request, wait for `done`,
            send the next, until --duration ends (or --count requests each); workers start
            over --ramp s; a `busy` refusal waits --busy-backoff s before the next request
Each request is timed at the client (time.monotonic at message arrival) and replayed through a
simulated real-time listener (`listen`): playback starts at the first audio byte and consumes
24 kHz in real time; an underrun is the next sample needed before it arrived, its stall lasts
until that audio comes. TTFA is measured from the scheduled arrival (open loop: queueing in the
client counts) or from the send (closed loop). Connections are spread over --procs worker
processes, each an asyncio loop; their per-request records are merged. GPU busy share comes from
pynvml or `nvidia-smi -lms 200` on this host (None without a GPU). docs/LOADGEN.md has every metric.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import signal
import sys
import time
from pathlib import Path

from higgs_stream.loadgen.report import log, plot, table
from higgs_stream.loadgen.runner import run
from higgs_stream.loadgen.schedule import LoadConfig
from higgs_stream.loadgen.spawn import spawned_server


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _gpus(s: str) -> int | tuple[int, ...]:
    ids = _ints(s)
    return ids[0] if len(ids) == 1 else ids


def build_parser() -> argparse.ArgumentParser:
    d = LoadConfig(url="")
    ap = argparse.ArgumentParser(prog="python -m higgs_stream.loadgen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts/stream")
    ap.add_argument("--open-rates", type=_floats, default=d.open_rates, help="open-loop rates, req/s (\"\" for none)")
    ap.add_argument("--closed", type=_ints, default=d.closed, help="closed-loop concurrencies (\"\" for none)")
    ap.add_argument("--duration", type=float, default=d.duration_s, help="seconds of arrivals per scenario")
    ap.add_argument("--count", type=int, default=None, help="closed loop: at most this many requests per worker")
    ap.add_argument("--seed", type=int, default=d.seed, help="arrival times and request seeds")
    ap.add_argument("--procs", type=int, default=min(4, os.cpu_count() or 1),
                    help="client processes (each an asyncio loop); 0 = one thread in this process")
    ap.add_argument("--text", default=d.text, help="the utterance (keep it one sentence: one segment)")
    ap.add_argument("--mode", choices=("exact", "low_latency"), default=None, help="default: the server's")
    ap.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    ap.add_argument("--drain", type=float, default=d.drain_s, help="seconds in-flight requests may take after --duration")
    ap.add_argument("--ramp", type=float, default=d.ramp_s, help="closed loop: workers start over this many seconds")
    ap.add_argument("--busy-backoff", type=float, default=d.busy_backoff_s)
    ap.add_argument("--warmup", type=int, default=d.warmup, help="concurrent warm-up requests before the scenarios")
    ap.add_argument("--time-budget", type=float, default=None, help="skip scenarios that would not finish in this many s")
    ap.add_argument("--gpu-index", type=_gpus, default=0,
                    help="GPU(s) to sample for the busy share: 0, or 0,1 for the replicas of a Ray Serve run (mean)")
    ap.add_argument("--spawn", default=None, help="start this server command, wait for /healthz, run, stop it")
    ap.add_argument("--spawn-timeout", type=float, default=600.0)
    ap.add_argument("--spawn-log", default=None, help="the spawned server's log (default: next to --out)")
    ap.add_argument("--label", default=None, help="name of this run in plots")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--plot", default=None, help="PNG file to write (needs matplotlib)")
    ap.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",  # .json or .json.gz (docs/bench)
                    help="only plot these result files (one line per file) to --plot")
    return ap


def read_result(path: Path) -> dict:
    """A result JSON, plain or gzipped (docs/bench keeps the large ones as .json.gz)."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def main(argv: list[str] | None = None) -> int:
    t_begin = time.monotonic()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot_from:
        results = [read_result(Path(p)) for p in args.plot_from]
        for r, p in zip(results, args.plot_from):
            r["label"] = r.get("label") or Path(p).stem
        for r in results:
            print(table(r))
        return 0 if plot(results, args.plot or "loadgen.png") else 1
    try:
        cfg = LoadConfig(url=args.url, open_rates=args.open_rates, closed=args.closed, duration_s=args.duration,
                         count=args.count, seed=args.seed, procs=args.procs, text=args.text, mode=args.mode,
                         request_timeout_s=args.request_timeout, drain_s=args.drain, ramp_s=args.ramp,
                         busy_backoff_s=args.busy_backoff, warmup=args.warmup, time_budget_s=args.time_budget,
                         gpu_index=args.gpu_index)
    except ValueError as e:
        parser.error(str(e))
    if args.spawn:  # SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the spawned server is stopped too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        log_path = Path(args.spawn_log or (Path(args.out).with_suffix(".server.log") if args.out else "loadgen_server.log"))
        with spawned_server(args.spawn, args.url, log_path, args.spawn_timeout):
            result = run(cfg, t_begin)
    else:
        result = run(cfg, t_begin)
    result["label"] = args.label
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        log(f"results written to {args.out}")
    print(table(result))
    if args.plot:
        plot([result], args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
