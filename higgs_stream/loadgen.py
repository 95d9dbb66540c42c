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
import asyncio
import contextlib
import http.client
import json
import math
import multiprocessing as mp
import os
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import aiohttp

SAMPLE_RATE = 24000
TEXT = ("The quick brown fox jumps over the lazy dog while the morning train rolls into the station, "
        "and she said good morning, how are you today, before the whole sentence had been spoken.")
CONTINUITY_MS = (50, 100, 200)
NET_ERRORS = (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError)  # a connection's failures
SCHEMA = 1


def log(msg: str) -> None:
    print(f"[loadgen {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the listener (pure)
@dataclass(frozen=True)
class Playback:
    """What a real-time listener heard of one stream."""

    first: float | None  # arrival time of the first audio (playback starts)
    samples: int
    stalls: tuple[float, ...]  # duration of each underrun (s), in order
    max_gap_s: float  # largest time between two audio arrivals

    @property
    def underruns(self) -> int:
        return len(self.stalls)

    @property
    def stall_s(self) -> float:
        return sum(self.stalls, 0.0)

    @property
    def max_stall_s(self) -> float:
        return max(self.stalls, default=0.0)


def listen(arrivals: Iterable[tuple[float, int]], sample_rate: int = SAMPLE_RATE) -> Playback:
    """Replay (arrival time, samples) in order: playback starts at the first audio and plays
    `sample_rate` samples per second; audio needed before it arrived is a stall lasting until it
    comes, then playback resumes. Arrivals exactly when the buffer runs dry do not stall."""
    first = last = None
    anchor_t, anchor_n, samples = 0.0, 0, 0  # playback (re)started at anchor_t with anchor_n samples delivered
    stalls: list[float] = []
    max_gap = 0.0
    for t, n in arrivals:
        if n <= 0:
            continue
        if first is None:
            first, anchor_t, anchor_n = t, t, 0
        else:
            max_gap = max(max_gap, t - last)
            dry_at = anchor_t + (samples - anchor_n) / sample_rate  # when the audio delivered so far runs out
            if t > dry_at:
                stalls.append(t - dry_at)
                anchor_t, anchor_n = t, samples
        samples += n
        last = t
    return Playback(first, samples, tuple(stalls), max_gap)


# ---------------------------------------------------------------------------- schedules and statistics
def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of a Poisson process of `rate` per second in [0, duration_s)."""
    assert rate > 0 and duration_s > 0, f"rate and duration must be > 0, got {rate}, {duration_s}"
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(values: Sequence[float]) -> dict[str, float | None]:
    ms = [v * 1e3 for v in values]
    return {"n": len(ms), "p50": percentile(ms, 50), "p95": percentile(ms, 95), "p99": percentile(ms, 99),
            "mean": sum(ms) / len(ms) if ms else None, "max": max(ms) if ms else None}


@dataclass(frozen=True)
class Scenario:
    kind: str  # "open" | "closed"
    load: float  # open: requests per second; closed: concurrent streams
    duration_s: float
    seed: int = 0
    count: int | None = None  # closed: at most this many requests per worker

    @property
    def name(self) -> str:
        return f"open@{self.load:g}/s" if self.kind == "open" else f"closed@{int(self.load)}"


def summarize(scenario: Scenario, records: list[dict], wall_s: float, gpu: list[float] | None,
              lags: list[dict]) -> dict:
    """One scenario's metrics from its per-request records (see docs/LOADGEN.md)."""
    heard = [r for r in records if r["first_audio"] is not None]
    audio_s = sum(r["samples"] for r in records) / SAMPLE_RATE
    outcomes = [r["outcome"] for r in records]
    codes: dict[str, int] = {}
    for r in records:
        if r["error_code"]:
            codes[r["error_code"]] = codes.get(r["error_code"], 0) + 1
    with_underrun = sum(r["underruns"] > 0 for r in heard)
    return {
        "name": scenario.name, "kind": scenario.kind, "load": scenario.load, "duration_s": scenario.duration_s,
        "seed": scenario.seed, "count": scenario.count, "requests": len(records),
        "completed": outcomes.count("completed"), "errored": outcomes.count("error") + outcomes.count("timeout"),
        "busy": outcomes.count("busy"), "timed_out": outcomes.count("timeout"), "error_codes": codes,
        "ttfa_ms": _ms([r["ttfa_s"] for r in heard]),
        "underruns": sum(r["underruns"] for r in heard), "underrun_s": sum(r["stall_s"] for r in heard),
        "streams_with_audio": len(heard), "streams_with_underrun": with_underrun,
        "underrun_share": with_underrun / len(heard) if heard else None,
        "max_stall_ms": max((r["max_stall_s"] for r in heard), default=0.0) * 1e3,
        "continuity": {str(ms): (sum(r["max_stall_s"] * 1e3 <= ms for r in heard) / len(heard) if heard else None)
                       for ms in CONTINUITY_MS},
        "audio_s": audio_s, "wall_s": wall_s, "audio_s_per_s": audio_s / wall_s if wall_s > 0 else None,
        "samples_per_stream": {"min": min((r["samples"] for r in heard), default=None),
                               "max": max((r["samples"] for r in heard), default=None)},
        "gpu_busy": sum(gpu) / len(gpu) / 100 if gpu else None, "gpu_samples": len(gpu or ()),
        "client": {"procs": len(lags), "send_lag_ms": _ms([r["sent"] - r["scheduled"] for r in records]),
                   "connect_ms": _ms([r["connect_s"] for r in records if r["connect_s"] is not None]),
                   "loop_lag_ms_max": max((x["loop_lag_s_max"] for x in lags), default=0.0) * 1e3},
        "streams": records,
    }


# ---------------------------------------------------------------------------- one request on one connection
@dataclass
class Part:
    """One process's share of a scenario (picklable)."""

    url: str
    kind: str
    text: str
    options: dict
    seed: int
    request_timeout_s: float
    duration_s: float
    drain_s: float
    arrivals: list[tuple[int, float]] = field(default_factory=list)  # open: (request index, s from t0)
    workers: list[tuple[int, float]] = field(default_factory=list)  # closed: (worker index, start s from t0)
    count: int | None = None
    busy_backoff_s: float = 1.0
    prewarm: int = 0  # open: connections opened before t0


class Pool:
    """Idle WebSocket connections of one process; a request takes one or opens a new one."""

    def __init__(self, url: str) -> None:
        self.url, self.idle = url, []
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))  # no cap on connections
        self.all: set = set()

    async def open(self):
        ws = await self.session.ws_connect(self.url, autoping=True, compress=0, max_msg_size=0)
        self.all.add(ws)
        return ws

    async def get(self) -> tuple[Any, float | None]:
        while self.idle:
            ws = self.idle.pop()
            if not ws.closed:
                return ws, None
        t = time.monotonic()
        ws = await self.open()
        return ws, time.monotonic() - t

    def put(self, ws) -> None:
        if not ws.closed:
            self.idle.append(ws)

    async def close(self) -> None:
        await asyncio.gather(*(ws.close() for ws in self.all if not ws.closed), return_exceptions=True)
        await self.session.close()


async def request(ws, cid: str, text: str, options: dict, deadline: float) -> dict:
    """Speak one context on `ws` and read until it is over; the arrival of every audio frame is
    recorded at the client. Outcome: completed | busy | error | timeout."""
    sent = time.monotonic()
    await ws.send_str(json.dumps({"type": "text", "context_id": cid, "text": text, **options}))
    await ws.send_str(json.dumps({"type": "end", "context_id": cid}))
    arrivals: list[tuple[float, int]] = []
    playing, reason, error, outcome, server_samples = False, None, None, None, None
    while outcome is None:
        try:
            msg = await asyncio.wait_for(ws.receive(), max(0.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError):
            outcome = "timeout"
            break
        now = time.monotonic()
        if msg.type == aiohttp.WSMsgType.BINARY:
            if playing:
                arrivals.append((now, len(msg.data) // 2))
            continue
        if msg.type != aiohttp.WSMsgType.TEXT:  # closed or failed
            error, outcome = error or "connection", "error"
            break
        ev = json.loads(msg.data)
        kind = ev.get("type")
        if ev.get("context_id") != cid:
            continue  # ready, or a connection-level message
        if kind == "audio_start":
            playing = True
        elif kind == "done":
            reason, server_samples = ev.get("reason"), ev.get("samples")
            outcome = "completed" if reason == "completed" else "busy" if error == "busy" else "error"
        elif kind == "error":
            if ev.get("code") == "not_found" and error is not None:  # our `end` after a refused `text`
                outcome = "busy" if error == "busy" else "error"
            error = error or ev.get("code", "internal")
    if outcome == "timeout":
        await ws.close()  # the server cancels the stream
    play = listen(arrivals)
    return {"sent": sent, "first_audio": play.first, "done": time.monotonic(), "outcome": outcome, "reason": reason,
            "error_code": error, "samples": play.samples, "server_samples": server_samples,
            "underruns": play.underruns, "stall_s": play.stall_s, "max_stall_s": play.max_stall_s,
            "stalls": [round(s, 4) for s in play.stalls], "max_gap_s": play.max_gap_s}


async def _loop_lag(stop: asyncio.Event, lags: list[float], every: float = 0.05) -> None:
    while not stop.is_set():
        t = time.monotonic()
        await asyncio.sleep(every)
        lags.append(time.monotonic() - t - every)


async def run_part(part: Part, go: Any) -> dict:
    """Open the connections, wait for `go()` (the common start time t0 on the monotonic clock,
    shared by every process of the host), run this process's requests, return their records."""
    pool = Pool(part.url)
    loop = asyncio.get_running_loop()
    records: list[dict] = []
    lags: list[float] = []
    stop = asyncio.Event()
    try:
        n_conns = part.prewarm if part.kind == "open" else len(part.workers)
        pool.idle = list(await asyncio.gather(*(pool.open() for _ in range(n_conns))))
        t0 = await loop.run_in_executor(None, go)
        lag_task = loop.create_task(_loop_lag(stop, lags))
        t_stop, hard_end = t0 + part.duration_s, t0 + part.duration_s + part.drain_s

        async def one(ws, idx: int, scheduled: float, connect_s: float | None, worker: int | None) -> dict:
            deadline = min(time.monotonic() + part.request_timeout_s, hard_end)
            try:
                rec = await request(ws, f"r{idx}", part.text, {**part.options, "seed": part.seed + idx}, deadline)
            except NET_ERRORS as e:  # the connection broke under us: this request's error, not the run's
                await ws.close()
                rec = _failed(idx, worker, scheduled, f"client: {type(e).__name__}")
            rec.update(id=idx, worker=worker, scheduled=scheduled, connect_s=connect_s,
                       ttfa_s=None if rec["first_audio"] is None else rec["first_audio"] - scheduled)
            records.append(rec)
            return rec

        async def arrival(idx: int, at: float) -> None:
            scheduled = t0 + at
            await asyncio.sleep(scheduled - time.monotonic())
            try:
                ws, connect_s = await pool.get()
            except NET_ERRORS as e:  # a refused connection is this request's error
                records.append(_failed(idx, None, scheduled, f"connect: {type(e).__name__}"))
                return
            rec = await one(ws, idx, scheduled, connect_s, None)
            if rec["outcome"] != "timeout":
                pool.put(ws)

        async def worker(w: int, start: float) -> None:
            await asyncio.sleep(t0 + start - time.monotonic())
            ws, connect_s, k = pool.idle.pop(), None, 0
            while time.monotonic() < t_stop and (part.count is None or k < part.count):
                idx = w * 1_000_000 + k
                k += 1
                if ws.closed:
                    try:
                        t = time.monotonic()
                        ws = await pool.open()
                        connect_s = time.monotonic() - t
                    except NET_ERRORS as e:
                        records.append(_failed(idx, w, time.monotonic(), f"connect: {type(e).__name__}"))
                        await asyncio.sleep(part.busy_backoff_s)
                        continue
                rec = await one(ws, idx, time.monotonic(), connect_s, w)
                connect_s = None
                if rec["outcome"] == "busy":
                    await asyncio.sleep(part.busy_backoff_s)

        if part.kind == "open":
            await asyncio.gather(*(arrival(i, at) for i, at in part.arrivals))
        else:
            await asyncio.gather(*(worker(w, start) for w, start in part.workers))
        stop.set()
        await lag_task
    finally:
        await pool.close()
    for r in records:  # times relative to t0
        for key in ("scheduled", "sent", "first_audio", "done"):
            r[key] = None if r[key] is None else r[key] - t0
    return {"records": records, "loop_lag_s_max": max(lags, default=0.0)}


def _failed(idx: int, worker: int | None, scheduled: float, code: str) -> dict:
    now = time.monotonic()
    return {"id": idx, "worker": worker, "scheduled": scheduled, "sent": now, "first_audio": None, "done": now,
            "outcome": "error", "reason": None, "error_code": code, "samples": 0, "server_samples": None,
            "underruns": 0, "stall_s": 0.0, "max_stall_s": 0.0, "stalls": [], "max_gap_s": 0.0, "connect_s": None,
            "ttfa_s": None}


def _proc_main(conn: Connection) -> None:
    """A client process (or thread): runs the parts it is sent, one at a time, until None."""
    while True:
        msg = conn.recv()
        if msg is None:
            return
        try:
            def go() -> float:
                conn.send(("ready", None))
                kind, t0 = conn.recv()
                assert kind == "go", f"expected go, got {kind}"
                return t0

            conn.send(("result", asyncio.run(run_part(msg, go))))
        except Exception:  # noqa: BLE001 - whatever it is, the parent raises it
            conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------------------- the parent: processes, GPU, server
class Clients:
    """`procs` client processes (0: one in-process thread), each with a pipe to this one."""

    def __init__(self, procs: int) -> None:
        self.conns: list[Connection] = []
        self.workers: list[Any] = []
        ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (a server in tests)
        for _ in range(max(procs, 1)):
            here, there = mp.Pipe()
            w = (threading.Thread(target=_proc_main, args=(there,), daemon=True) if procs == 0
                 else ctx.Process(target=_proc_main, args=(there,), daemon=True))
            w.start()
            self.conns.append(here)
            self.workers.append(w)

    def run(self, parts: list[Part], timeout_s: float, on_start: Any = None) -> tuple[float, list[dict]]:
        """Send one part per client, wait until all are connected, start them at one t0, collect."""
        assert len(parts) == len(self.conns)
        for conn, part in zip(self.conns, parts):
            conn.send(part)
        self._expect("ready", 120.0)
        t0 = time.monotonic() + 0.05
        if on_start is not None:
            on_start(t0)
        for conn in self.conns:
            conn.send(("go", t0))
        return t0, self._expect("result", timeout_s)

    def _expect(self, kind: str, timeout_s: float) -> list:
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.conns):
            ready = wait([c for i, c in enumerate(self.conns) if i not in got], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"client processes did not report {kind} within {timeout_s:.0f} s")
            for c in ready:
                what, value = c.recv()
                if what == "error":
                    raise RuntimeError(f"a client process failed:\n{value}")
                assert what == kind, f"expected {kind}, got {what}"
                got[self.conns.index(c)] = value
        return [got[i] for i in range(len(self.conns))]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0  # idle clients exit at once; interrupted ones are terminated
        for w in self.workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
            if isinstance(w, mp.process.BaseProcess) and w.is_alive():
                w.terminate()


class GpuMonitor:
    """GPU utilization (% of time a kernel ran) every 200 ms, from pynvml or `nvidia-smi -lms 200`."""

    def __init__(self, index: int = 0, period_s: float = 0.2) -> None:
        self.samples: list[tuple[float, float]] = []
        self.source: str | None = None
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        reader = self._nvml(index, period_s) or self._smi(index, period_s)
        if reader is not None:
            threading.Thread(target=reader, daemon=True, name="gpu-monitor").start()

    def _nvml(self, index: int, period_s: float):
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetUtilizationRates(handle)
        except pynvml.NVMLError:  # no driver or no such GPU: try nvidia-smi
            return None
        self.source = "pynvml"

        def read() -> None:
            while not self._stop.wait(period_s):
                self.samples.append((time.monotonic(), float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)))
        return read

    def _smi(self, index: int, period_s: float):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
        self._proc = subprocess.Popen([exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                       "-lms", str(int(period_s * 1000)), "-i", str(index)],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.source = "nvidia-smi"

        def read() -> None:
            for line in self._proc.stdout:
                try:
                    self.samples.append((time.monotonic(), float(line.strip())))
                except ValueError:
                    continue
        return read

    def window(self, t0: float, t1: float) -> list[float] | None:
        """Samples taken in [t0, t1]; None when there is no GPU monitor."""
        if self.source is None:
            return None
        return [v for t, v in list(self.samples) if t0 <= t <= t1]

    def close(self) -> None:
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=5)


def http_base(url: str) -> str:
    """ws://host:port/path -> http://host:port (wss -> https)."""
    scheme, _, rest = url.partition("://")
    return ("https" if scheme == "wss" else "http") + "://" + rest.split("/", 1)[0]


def healthz(url: str, timeout_s: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(http_base(url) + "/healthz", timeout=timeout_s) as r:
            return json.loads(r.read())
    except (OSError, ValueError, http.client.HTTPException):  # not up (yet)
        return None


@contextlib.contextmanager
def spawned_server(command: str, url: str, log_path: Path, timeout_s: float) -> Iterator[subprocess.Popen]:
    """`--spawn "higgs-stream serve ..."`: start it, wait for /healthz, yield, stop it (SIGINT, then harder)."""
    log(f"starting the server: {command} (log: {log_path})")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(shlex.split(command), stdout=out, stderr=subprocess.STDOUT)
        try:
            t0 = time.monotonic()
            while healthz(url) is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy:\n"
                                       + _tail(log_path))
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"the server was not healthy after {timeout_s:.0f} s:\n" + _tail(log_path))
                time.sleep(0.5)
            log(f"server healthy after {time.monotonic() - t0:.1f} s")
            yield proc
        finally:
            for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                if proc.poll() is not None:
                    break
                proc.send_signal(sig)
                try:
                    proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    continue


def _tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


# ---------------------------------------------------------------------------- scenarios
@dataclass(frozen=True)
class LoadConfig:
    url: str
    open_rates: tuple[float, ...] = (1, 5, 10, 20)
    closed: tuple[int, ...] = (16, 64, 128, 256, 512)
    duration_s: float = 20.0
    count: int | None = None  # closed: requests per worker at most
    seed: int = 0
    procs: int = 4
    text: str = TEXT
    mode: str | None = None  # None: the server's default
    request_timeout_s: float = 120.0
    drain_s: float = 60.0  # after --duration, how long in-flight requests may take to finish
    ramp_s: float = 1.0
    busy_backoff_s: float = 1.0  # the server's Retry-After
    prewarm_s: float = 1.0  # open: connections opened before t0 = rate x this
    warmup: int = 2
    time_budget_s: float | None = None
    gpu_index: int = 0

    def __post_init__(self) -> None:
        checks = {"open rates must be > 0": all(r > 0 for r in self.open_rates),
                  "closed-loop N must be >= 1": all(n >= 1 for n in self.closed),
                  "duration, request timeout and ramp must be > 0, drain >= 0":
                      self.duration_s > 0 and self.request_timeout_s > 0 and self.ramp_s >= 0 and self.drain_s >= 0,
                  "procs must be >= 0 (0: one thread in this process)": self.procs >= 0,
                  "count and warmup must be >= 0": (self.count or 0) >= 0 and self.warmup >= 0}
        bad = [what for what, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"bad load-generator settings: {'; '.join(bad)} ({self})")

    def scenarios(self) -> list[Scenario]:
        return ([Scenario("open", r, self.duration_s, self.seed) for r in self.open_rates]
                + [Scenario("closed", n, self.duration_s, self.seed, self.count) for n in self.closed])


def parts_for(cfg: LoadConfig, sc: Scenario, procs: int, drain_s: float) -> list[Part]:
    """Split a scenario over `procs` clients: arrivals and workers round-robin."""
    options = {"mode": cfg.mode} if cfg.mode else {}
    parts = [Part(url=cfg.url, kind=sc.kind, text=cfg.text, options=options, seed=sc.seed * 1_000_003,
                  request_timeout_s=cfg.request_timeout_s, duration_s=sc.duration_s, drain_s=drain_s,
                  count=sc.count, busy_backoff_s=cfg.busy_backoff_s) for _ in range(procs)]
    if sc.kind == "open":
        for i, at in enumerate(poisson_arrivals(sc.load, sc.duration_s, sc.seed)):
            parts[i % procs].arrivals.append((i, at))
        for p in parts:
            p.prewarm = math.ceil(sc.load * cfg.prewarm_s / procs)
    else:
        n = int(sc.load)
        ramp = min(cfg.ramp_s, sc.duration_s / 2)
        for w in range(n):
            parts[w % procs].workers.append((w, ramp * w / n))
    return parts


def run_scenario(cfg: LoadConfig, clients: Clients, gpu: GpuMonitor, sc: Scenario, drain_s: float) -> dict:
    procs = len(clients.conns)
    parts = parts_for(cfg, sc, procs, drain_s)
    t0, results = clients.run(parts, sc.duration_s + drain_s + cfg.request_timeout_s + 60)
    records = []
    for p, res in enumerate(results):
        for r in res["records"]:
            r["proc"] = p
            records.append(r)
    records.sort(key=lambda r: (r["scheduled"], r["id"]))
    wall = max((r["done"] for r in records), default=sc.duration_s)
    return summarize(sc, records, wall, gpu.window(t0, t0 + wall), results)


def run(cfg: LoadConfig, t_begin: float | None = None) -> dict:
    """Every scenario of `cfg` against a running server; the result document (see docs/LOADGEN.md).
    `t_begin`: when the time budget started (default now; --spawn counts the server's start-up)."""
    t_begin = time.monotonic() if t_begin is None else t_begin
    health = healthz(cfg.url)
    if health is None:
        log(f"warning: {http_base(cfg.url)}/healthz did not answer; trying the WebSocket anyway")
    result: dict[str, Any] = {
        "schema": SCHEMA, "url": cfg.url, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(), "config": {**asdict(cfg), "text_chars": len(cfg.text)}, "server": health,
        "gpu_source": None, "warmup": None, "scenarios": [], "skipped": [],
    }
    clients = Clients(cfg.procs)
    gpu = GpuMonitor(cfg.gpu_index)
    result["gpu_source"] = gpu.source
    try:
        if cfg.warmup:
            warm = Scenario("closed", cfg.warmup, 1.0, cfg.seed + 7, count=1)  # one request per worker
            result["warmup"] = _brief(run_scenario(cfg, clients, gpu, warm, cfg.request_timeout_s))
            log(f"warm-up: {result['warmup']}")
        for sc in cfg.scenarios():
            drain = cfg.drain_s
            if cfg.time_budget_s is not None:
                left = cfg.time_budget_s - (time.monotonic() - t_begin) - sc.duration_s - 5
                if left < min(10.0, cfg.drain_s):
                    result["skipped"].append(sc.name)
                    log(f"{sc.name}: skipped (time budget {cfg.time_budget_s:.0f} s)")
                    continue
                drain = min(drain, left)
            log(f"{sc.name}: running for {sc.duration_s:g} s (+ up to {drain:.0f} s to finish)")
            res = run_scenario(cfg, clients, gpu, sc, drain)
            result["scenarios"].append(res)
            log(f"{sc.name}: {_brief(res)}")
    finally:
        clients.close()
        gpu.close()
    result["server_after"] = healthz(cfg.url)
    result["wall_s"] = time.monotonic() - t_begin
    return result


def _brief(s: dict) -> str:
    t = s["ttfa_ms"]
    return (f"{s['requests']} requests, {s['completed']} completed, {s['errored']} errored, {s['busy']} busy; "
            f"TTFA p50 {_fmt(t['p50'], '.0f')} p95 {_fmt(t['p95'], '.0f')} ms; underruns {s['underruns']} "
            f"({s['streams_with_underrun']}/{s['streams_with_audio']} streams); {s['audio_s_per_s'] or 0:.1f} audio-s/s")


# ---------------------------------------------------------------------------- output
def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict) -> str:
    head = (f"{'scenario':<14}{'sent':>6}{'ok':>6}{'err':>5}{'busy':>6}{'TTFA p50':>10}{'p95':>8}{'p99':>8}"
            f"{'underruns':>10}{'stall s':>9}{'w/ und.':>8}{'cont100':>8}{'audio-s/s':>10}{'GPU':>6}")
    lines = [head]
    for s in result["scenarios"]:
        t = s["ttfa_ms"]
        lines.append(f"{s['name']:<14}{s['requests']:>6}{s['completed']:>6}{s['errored']:>5}{s['busy']:>6}"
                     f"{_fmt(t['p50'], '.0f'):>10}{_fmt(t['p95'], '.0f'):>8}{_fmt(t['p99'], '.0f'):>8}{s['underruns']:>10}"
                     f"{s['underrun_s']:>9.2f}{s['streams_with_underrun']:>8}{_fmt(s['continuity']['100'], '.2f'):>8}"
                     f"{_fmt(s['audio_s_per_s'], '.1f'):>10}{_fmt(s['gpu_busy'], '.0%'):>6}")
    if result.get("skipped"):
        lines.append(f"skipped (time budget): {', '.join(result['skipped'])}")
    return "\n".join(lines)


def plot(results: Sequence[dict], path: str | Path, labels: Sequence[str] | None = None) -> bool:
    """TTFA p50/p95 and underrun share vs load, one row per scenario family, one line per result."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not importable: no plot written to {path} (pip install matplotlib; "
            f"or re-plot later with --plot-from JSON --plot PNG)")
        return False
    labels = list(labels or [r.get("label") or f"run {i}" for i, r in enumerate(results)])
    kinds = [k for k in ("open", "closed") if any(s["kind"] == k for r in results for s in r["scenarios"])]
    if not kinds:
        log("nothing to plot (no scenarios ran)")
        return False
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 3.8 * len(kinds)), squeeze=False)
    nan = float("nan")
    for row, kind in zip(axes, kinds):
        for i, (r, label) in enumerate(zip(results, labels)):
            ss = sorted((s for s in r["scenarios"] if s["kind"] == kind), key=lambda s: s["load"])
            x, color = [s["load"] for s in ss], f"C{i}"
            for q, style in (("p50", "-o"), ("p95", "--s")):
                row[0].plot(x, [_or(s["ttfa_ms"][q], nan) for s in ss], style, color=color, label=f"{label} TTFA {q}")
            row[1].plot(x, [_or(s["underrun_share"], nan) for s in ss], "-o", color=color,
                        label=f"{label} streams with an underrun")
            row[1].plot(x, [s["busy"] / s["requests"] if s["requests"] else nan for s in ss], ":x", color=color,
                        label=f"{label} busy-refused")
        loads = [s["load"] for r in results for s in r["scenarios"] if s["kind"] == kind]
        xlabel = "arrival rate (requests/s, Poisson)" if kind == "open" else "concurrent streams (closed loop)"
        row[0].set(xlabel=xlabel, ylabel="time to first audio (ms)", title=f"{kind} loop: TTFA")
        row[1].set(xlabel=xlabel, ylabel="share of requests", ylim=(-0.02, 1.02), title=f"{kind} loop: underruns")
        for ax in row:
            if max(loads) >= 8 * min(loads):
                ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"plot written to {path}")
    return True


# ---------------------------------------------------------------------------- CLI
def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


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
    ap.add_argument("--gpu-index", type=int, default=0)
    ap.add_argument("--spawn", default=None, help="start this server command, wait for /healthz, run, stop it")
    ap.add_argument("--spawn-timeout", type=float, default=600.0)
    ap.add_argument("--spawn-log", default=None, help="the spawned server's log (default: next to --out)")
    ap.add_argument("--label", default=None, help="name of this run in plots")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--plot", default=None, help="PNG file to write (needs matplotlib)")
    ap.add_argument("--plot-from", nargs="+", default=None, metavar="JSON",
                    help="only plot these result files (one line per file) to --plot")
    return ap


def main(argv: list[str] | None = None) -> int:
    t_begin = time.monotonic()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot_from:
        results = [json.loads(Path(p).read_text()) for p in args.plot_from]
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
