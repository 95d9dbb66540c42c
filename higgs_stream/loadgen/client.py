"""The WebSocket clients: one request on one connection (timed at the client, replayed through the
listener), a process's requests of one scenario (`run_part`: a pool of connections, open-loop
arrivals or closed-loop workers), and the client processes that run them (`Clients`)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import aiohttp

from higgs_stream.loadgen.listener import listen
from higgs_stream.loadgen.schedule import Part

NET_ERRORS = (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError)  # a connection's failures
REPLICA_HEADER = "X-Higgs-Replica"  # the Ray Serve replica that took a connection (stream/ray_app.py)
PREWARM_TIMEOUT_S = 10.0  # a connection opened before t0 that a server behind Ray Serve queues: give up on it


def _refusal(e: BaseException) -> tuple[str, str]:
    """(outcome, error code) of a connection that could not be opened: a 503 on the upgrade is
    `busy` (Ray Serve's proxy refuses connections over capacity), anything else an error."""
    if isinstance(e, aiohttp.WSServerHandshakeError) and e.status == 503:
        return "busy", "busy"
    return "error", f"connect: {type(e).__name__}"


class Pool:
    """Idle WebSocket connections of one process; a request takes one or opens a new one."""

    def __init__(self, url: str) -> None:
        self.url, self.idle = url, []
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))  # no cap on connections
        self.all: set = set()
        self.replica: dict[Any, str | None] = {}  # connection -> the Serve replica behind it (None: no header)

    async def open(self):
        ws = await self.session.ws_connect(self.url, autoping=True, compress=0, max_msg_size=0)
        self.all.add(ws)
        response = getattr(ws, "_response", None)  # the upgrade response (aiohttp keeps it there)
        self.replica[ws] = response.headers.get(REPLICA_HEADER) if response is not None else None
        return ws

    async def prewarm(self, n: int) -> None:
        """Open up to `n` idle connections; one refused or held in a proxy's queue is left out."""
        opened = await asyncio.gather(*(asyncio.wait_for(self.open(), PREWARM_TIMEOUT_S) for _ in range(n)),
                                      return_exceptions=True)
        self.idle = [ws for ws in opened if not isinstance(ws, BaseException)]

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
            "stalls": [round(s, 4) for s in play.stalls], "stalls_at": [round(s, 4) for s in play.stalls_at],
            "max_gap_s": play.max_gap_s}


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
        await pool.prewarm(part.prewarm if part.kind == "open" else len(part.workers))
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
            rec.update(id=idx, worker=worker, scheduled=scheduled, connect_s=connect_s, replica=pool.replica.get(ws),
                       ttfa_s=None if rec["first_audio"] is None else rec["first_audio"] - scheduled)
            records.append(rec)
            return rec

        async def arrival(idx: int, at: float) -> None:
            scheduled = t0 + at
            await asyncio.sleep(scheduled - time.monotonic())
            try:
                ws, connect_s = await pool.get()
            except NET_ERRORS as e:  # a refused connection is this request's error (or busy)
                outcome, code = _refusal(e)
                records.append(_failed(idx, None, scheduled, code, outcome))
                return
            rec = await one(ws, idx, scheduled, connect_s, None)
            if rec["outcome"] != "timeout":
                pool.put(ws)

        async def worker(w: int, start: float) -> None:
            await asyncio.sleep(t0 + start - time.monotonic())
            ws, connect_s, k = pool.idle.pop() if pool.idle else None, None, 0
            while time.monotonic() < t_stop and (part.count is None or k < part.count):
                idx = w * 1_000_000 + k
                k += 1
                if ws is None or ws.closed:
                    try:
                        t = time.monotonic()
                        ws = await pool.open()
                        connect_s = time.monotonic() - t
                    except NET_ERRORS as e:
                        outcome, code = _refusal(e)
                        records.append(_failed(idx, w, time.monotonic(), code, outcome))
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


def _failed(idx: int, worker: int | None, scheduled: float, code: str, outcome: str = "error") -> dict:
    now = time.monotonic()
    return {"id": idx, "worker": worker, "scheduled": scheduled, "sent": now, "first_audio": None, "done": now,
            "outcome": outcome, "reason": None, "error_code": code, "samples": 0, "server_samples": None,
            "underruns": 0, "stall_s": 0.0, "max_stall_s": 0.0, "stalls": [], "stalls_at": [], "max_gap_s": 0.0, "connect_s": None,
            "ttfa_s": None, "replica": None}


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
