"""The WebSocket protocol (stream/PROTOCOL.md §1) over any transport: a `Connection` is four
calls (`receive`, `send_text`, `send_bytes`, `close`); `run_websocket` is what happens after the
upgrade (auth, the session, the close code), `SessionRunner` the session itself over any message
channel (the WebRTC data channel too). The aiohttp server (stream/server.py) and the ASGI app
(stream/asgi.py, what Ray Serve's proxy speaks) only wrap their socket in a `Connection`.

A reader task runs beside the writer: a peer that leaves is seen at once (also where sends never
fail, as behind Ray Serve's proxy), and every stream the session opened is cancelled, so its engine
pages are freed within one step. Every accepted context ends with `done` or `error`: a failing
message fails alone, a context left open and idle times out, and should the session itself fail,
its contexts end with `internal` and the socket closes with 1011.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from higgs_stream.engine.errors import HiggsStreamError
from higgs_stream.stream.errors import ForbiddenOriginError, IdleTimeoutError, ShuttingDownError
from higgs_stream.stream.guards import authorized, check_origin
from higgs_stream.stream.handle import Audio, StreamHandle
from higgs_stream.stream.routes import Reply, Request, failure_reply
from higgs_stream.stream.server_state import ServerState
from higgs_stream.stream.session import Cancel, Close, Command, Open, Session, Speak

log = logging.getLogger(__name__)

CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_INTERNAL = 1000, 1001, 1008, 1009, 1011
DRAIN_POLL_S = 0.05  # drain(): how often it looks whether the open streams have ended
SHUTDOWN_FLUSH_S = 5.0  # drain(): how long the sessions get to send the errors of the streams it ended


class Connection(Protocol):
    """An accepted WebSocket. `receive()` returns the next message (str or bytes) or None once the
    peer has gone (or the message was over the hard size limit: the connection closed it, 1009);
    sends raise ConnectionError when the peer is gone; `close()` is a no-op when already closed."""

    async def receive(self) -> str | bytes | None: ...

    async def send_text(self, text: str) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    async def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None: ...


def websocket_refusal(state: ServerState, request: Request) -> Reply | None:
    """Before the upgrade: a browser from an origin that is not allowed is refused (403), so a
    cross-site page cannot hijack the socket. None: upgrade."""
    try:
        check_origin(request, state.config)
    except ForbiddenOriginError as e:
        return failure_reply(e, state)
    return None


async def run_websocket(state: ServerState, request: Request, conn: Connection) -> None:
    """After the upgrade: the token (a wrong one gets `error{unauthorized}` and close 1008), then
    the session until the peer goes; a session failure closes with 1011. Always closes `conn`."""
    state.sockets.add(conn)
    state.metrics.connections.inc()
    try:
        if not authorized(request, state.config.token):
            state.metrics.errors.inc(code="unauthorized")
            await conn.send_text(json.dumps({"type": "error", "code": "unauthorized", "message": "wrong or missing token"}))
            await conn.close(CLOSE_POLICY, "unauthorized")
            return
        runner = SessionRunner(state, conn.send_text, conn.send_bytes, dict(request.query.items()))
        try:
            await runner.run(conn.receive)
        except Exception:
            log.exception("websocket session failed")
            await conn.close(CLOSE_INTERNAL, "internal error")
    finally:
        state.metrics.connections.dec()
        state.sockets.discard(conn)
        await conn.close()


async def drain(state: ServerState, timeout_s: float) -> None:
    """Graceful shutdown (aiohttp's on SIGTERM / SIGINT, the ASGI lifespan's end): the pipeline refuses new streams
    (`shutting_down`, HTTP 503 + Retry-After; `/healthz` says "draining") while the open ones run to their end, their
    audio delivered, for up to `timeout_s`; what is left then ends with `error{shutting_down}` + `done` (HTTP: the
    error of its format). Then every WebSocket closes with 1001."""
    pipeline = state.pipeline
    pipeline.draining = True
    loop = asyncio.get_running_loop()

    async def until(done: Callable[[], bool], seconds: float) -> bool:
        deadline = loop.time() + seconds
        while not done():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    def delivered() -> bool:  # every session has sent its contexts' `done` (over WebRTC: played it)
        return not any(r.handles or r.playing_out for r in list(state.sessions))

    if pipeline.active or not delivered():
        log.info("draining: %d streams open; waiting up to %g s", pipeline.active, timeout_s)
    if not await until(lambda: not pipeline.active and delivered(), timeout_s):
        ended = pipeline.end_all(ShuttingDownError(f"the server is shutting down: the stream did not end within its "
                                                   f"{timeout_s:g} s drain"))
        log.warning("drain: %g s over; %d streams ended with shutting_down", timeout_s, ended)
        await until(delivered, SHUTDOWN_FLUSH_S)
    await close_sockets(state)


async def close_sockets(state: ServerState) -> None:
    """Server shutdown: every open WebSocket closes with 1001."""
    for conn in list(state.sockets):
        await conn.close(CLOSE_GOING_AWAY, "server shutdown")


class SessionRunner:
    """Runs the WebSocket protocol (PROTOCOL.md §1) over any message channel.

    `send_text(str)` / `send_bytes(bytes)` deliver to the peer; `receive()` returns the next
    client message (str or bytes) or None once the peer has gone. A reader task and a writer
    task run side by side; whichever ends first ends the session and cancels every open stream.
    """

    def __init__(self, state: ServerState, send_text: Callable[[str], Awaitable], send_bytes: Callable[[bytes], Awaitable],
                 query: dict[str, str] | None = None, transport: str = "ws", plays_out: bool = False):
        self.state = state
        self.transport = transport  # metrics label
        self._send_text, self._send_bytes = send_text, send_bytes
        # a plain function of the metrics, not a method of this runner: a bound method made runner -> session ->
        # runner a cycle, so every closed connection's objects waited for a garbage collection (a probe)
        errors = state.metrics.errors
        self._count_error = lambda code: errors.inc(code=code)
        self.session = Session(state.config, state.voices, query, on_error=self._count_error)
        self.handles: dict[str, StreamHandle] = {}  # contexts whose `done` is not sent yet
        # `plays_out` (WebRTC): the transport plays audio seconds after it takes it, so a completed context waits
        # here, uncounted, until its `done` plays (`played`) or will not (`unplayed`, or the session ends)
        self._plays_out = plays_out
        self.playing_out: dict[str, StreamHandle] = {}
        state.sessions.add(self)
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._quiet_since = self._loop.time()  # the last message, or the last context's end (the idle clock)

    async def run(self, receive: Callable[[], Awaitable[str | bytes | None]]) -> None:
        """Until the peer goes or the session fails. A failure (a server bug) ends every live context
        with `error{internal}` + `done` (sent as far as the channel still takes them), then raises."""
        reader = asyncio.create_task(self._read(receive), name="session-reader")
        writer = asyncio.create_task(self._write(), name="session-writer")
        failure = None
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, writer):
                task.cancel()
            results = await asyncio.gather(reader, writer, return_exceptions=True)
            failure = next((r for r in results if isinstance(r, BaseException)
                            and not isinstance(r, (ConnectionError, asyncio.CancelledError))), None)
            for handle in [*self.handles.values(), *self.playing_out.values()]:  # still open: its peer went (or
                handle.cancel("cancelled" if failure is not None else "disconnected")  # the session failed)
            self.handles.clear()
            self.playing_out.clear()
            if failure is not None:
                self.session.fail_all(HiggsStreamError("internal error: the session failed"))
                await self._flush_quietly()
        if failure is not None:
            raise failure

    async def _flush_quietly(self) -> None:
        try:
            async with asyncio.timeout(1.0):
                await self._flush()
        except Exception as e:  # noqa: BLE001 -- the channel is failing too; the transport closes it next
            log.info("could not send the final errors: %r", e)

    async def _read(self, receive) -> None:
        rate = self.state.config.max_messages_per_s
        budget, last = rate, self._loop.time()  # a token bucket: `rate` messages a second, bursts of `rate`
        while True:
            message = await receive()
            if message is None:
                return
            now = self._loop.time()
            budget, last = min(rate, budget + (now - last) * rate) - 1, now
            self._quiet_since = now
            self._execute(self.session.receive(message, now))
            self._wake.set()
            if budget < 0:  # a flood: read on once the budget refills (its sender waits on TCP, nobody else)
                await asyncio.sleep(-budget / rate)

    def _idle_at(self) -> float | None:
        """When the connection times out: `idle_timeout_s` after its last message or its last context's end,
        while no context is open (None: one is; its audio may take long to finish)."""
        return None if self.handles else self._quiet_since + self.state.config.idle_timeout_s

    async def _time_out_connection(self) -> None:
        self._count_error(IdleTimeoutError.code)
        idle_s = self.state.config.idle_timeout_s
        await self._send_text(json.dumps({"type": "error", "code": IdleTimeoutError.code,
                                          "message": f"no message and no open context for {idle_s:g} s"}))

    def _execute(self, commands: list[Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, Open):
                try:
                    handle = self.state.pipeline.open(cmd.options, transport=self.transport, stream_id=cmd.context_id)
                except Exception as e:
                    if not isinstance(e, HiggsStreamError):
                        log.exception("opening context %r failed", cmd.context_id)
                        e = HiggsStreamError(f"internal error: {type(e).__name__}")
                    self.session.reject(cmd.context_id, e)
                    continue
                handle.set_waker(self._wake.set)
                self.handles[cmd.context_id] = handle
                continue
            handle = self.handles.get(cmd.context_id)
            if handle is None:
                continue  # its Open was rejected
            if isinstance(cmd, Speak):
                handle.say(cmd.text)
            elif isinstance(cmd, Close):
                handle.close()
            elif isinstance(cmd, Cancel):
                del self.handles[cmd.context_id]
                handle.cancel() if cmd.error is None else handle.fail(cmd.error)
                self._quiet_since = max(self._quiet_since, self._loop.time())

    async def _write(self) -> None:
        max_bytes = self.state.config.max_send_bytes
        while True:
            self._wake.clear()
            now = self._loop.time()
            self._execute(self.session.tick(now))
            self._time_out_idle(now)
            await self._flush()
            head = self.session.head
            if head is not None:
                handle = self.handles[head]
                events = handle.take(max_bytes, first_alone=not self.session.audio_started(head),
                                     defer_completed=self._plays_out)
                if events:
                    self.session.touch(head, self._loop.time())
                    for ev in events:
                        if isinstance(ev, Audio):
                            self.session.audio(head, ev.pcm)
                        else:
                            del self.handles[head]
                            if self._plays_out and ev.reason == "completed":
                                self.playing_out[head] = handle
                            self._quiet_since = max(self._quiet_since, self._loop.time())
                            self.session.finished(head, ev.reason, ev.error)
                    continue
            idle_at = self._idle_at()
            if idle_at is not None and self._loop.time() >= idle_at:
                await self._time_out_connection()
                return
            deadline = min((t for t in (self.session.deadline(), idle_at) if t is not None), default=None)
            timeout = None if deadline is None else max(0.0, deadline - self._loop.time())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    def played(self, context_id: str) -> None:
        """`plays_out`: the context's `done` played after all its audio: counted `completed`."""
        handle = self.playing_out.pop(context_id, None)
        if handle is not None:
            handle.delivered()

    def unplayed(self, context_id: str, reason: str) -> None:
        """`plays_out`: the context's rest will not play (a `cancel` during playout, the peer gone): counted `reason`."""
        handle = self.playing_out.pop(context_id, None)
        if handle is not None:
            handle.cancel(reason)

    def _time_out_idle(self, now: float) -> None:
        """End the open contexts that neither the client nor the pipeline touched for `context_idle_s`."""
        for cid in self.session.idle(now):
            handle = self.handles.get(cid)
            if handle is not None and (handle.busy or now - handle.active_at < self.state.config.context_idle_s):
                self.session.touch(cid, now if handle.busy else handle.active_at)
                continue
            self._execute(self.session.time_out(cid))

    async def _flush(self) -> None:
        for frame in self.session.outgoing():
            if isinstance(frame, bytes):
                await self._send_bytes(frame)
            else:
                await self._send_text(frame)
