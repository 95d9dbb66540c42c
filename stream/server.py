"""The aiohttp app on one port: WebSocket streaming, health, metrics, voices, the demo, and the
routes of stream/http_speech.py and stream/webrtc.py (`higgs-stream serve` runs it: stream/serve_command.py).

A thin adapter: what each route does is written once, independent of the web framework
(stream/routes.py, stream/http_speech.py, stream/driver.py), and stream/asgi.py is the other
adapter (Starlette / ASGI, what Ray Serve's proxy speaks). Here an aiohttp request becomes a
`Request`, a reply becomes an aiohttp response, and a WebSocket a `Connection`. HTTP handlers are
cancelled by aiohttp when the connection drops, which needs `handler_cancellation=True` (as
`serve()` sets). Wire format: stream/PROTOCOL.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading

from aiohttp import WSMsgType, http_exceptions, web
from higgs_stream.engine.errors import ConfigError
from higgs_stream.stream import routes
from higgs_stream.stream.driver import (
    CLOSE_NORMAL,
    SessionRunner,
    drain,
    run_websocket,
    websocket_refusal,
)
from higgs_stream.stream.errors import BadJsonError, TooLargeError
from higgs_stream.stream.guards import CORS_ROUTES, error_reply
from higgs_stream.stream.http_speech import speech
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.stream.routes import Reply, Request, StreamAborted, StreamReply
from higgs_stream.stream.server_state import STATE, ServerState, listening_sockets, start_pipeline
from higgs_stream.stream.thread_profile import StackSampler, write_profile

__all__ = ["SessionRunner", "make_app", "serve", "bound_port", "startup_line"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- aiohttp <-> routes

# request key: the body could not be read, the answer closes the connection (a typed key where aiohttp has them: a
# plain string key warns NotAppKeyWarning in aiohttp 3.14, what CI installs)
CLOSE_AFTER = web.RequestKey("higgs_close_after", bool) if hasattr(web, "RequestKey") else "higgs_close_after"


def request_view(request: web.Request) -> Request:
    """The framework-neutral view of an aiohttp request (its body read within `client_max_size`)."""

    async def read() -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise TooLargeError(f"request body over {request.app[STATE].config.hard_message_bytes} bytes") from None
        except web.RequestPayloadError as e:  # a body its Content-Encoding cannot decode, a chunked body cut short
            # (a 500 and two logged tracebacks before, a probe): the body ends here, so aiohttp does not read the rest
            # of it after the answer (and raise again); the answer closes the connection (`respond`)
            request.content.feed_eof()
            request[CLOSE_AFTER] = True
            cause = e.__cause__ if e.__cause__ is not None else e
            raise BadJsonError(f"request body could not be read: {type(cause).__name__}") from None

    return Request(request.method, request.path, request.headers, request.query, request.host or "", read)


async def respond(request: web.Request, reply: Reply | StreamReply) -> web.StreamResponse:
    """An aiohttp response for a route's reply; a StreamReply is written as it is produced."""
    if isinstance(reply, Reply):
        headers = dict(reply.headers)
        if reply.content_type:
            headers["Content-Type"] = reply.content_type
        resp = web.Response(status=reply.status, body=reply.body, headers=headers)
        if request.get(CLOSE_AFTER):
            resp.force_close()
        return resp
    try:
        resp = web.StreamResponse(status=reply.status, headers={**reply.headers, "Content-Type": reply.content_type})
        await resp.prepare(request)
        try:
            async for chunk in reply.chunks:
                await resp.write(chunk)
        except StreamAborted:
            if request.transport is not None:
                request.transport.close()  # no final chunk: the client sees a truncated body
            return resp
        try:
            await resp.write_eof()
        except ConnectionError:  # the client closed as the body ended (an ERROR traceback before, from a probe)
            log.info("%s %s: the client closed before the end of the body", request.method, request.path)
        return resp
    finally:
        await reply.close()


def error_response(error, metrics: Metrics, status: int | None = None) -> web.Response:
    """A JSON error response (PROTOCOL.md §3) for aiohttp routes outside stream/routes.py (WebRTC)."""
    metrics.errors.inc(code=error.code)
    status, body, headers = error_reply(error, status)
    return web.json_response(body, status=status, headers=headers)


TCP_INFO_BYTES_ACKED = 120  # Linux struct tcp_info: offset of tcpi_bytes_acked (u64, since Linux 4.1)


def tcp_acked(transport: asyncio.BaseTransport | None) -> int | None:
    """Bytes the peer's TCP has acknowledged on this connection (Linux; None where unknown): it grows while the
    peer's application reads, and stops once it stops reading and its receive buffer is full."""
    sock = None if transport is None else transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    return struct.unpack_from("Q", info, TCP_INFO_BYTES_ACKED)[0] if len(info) >= TCP_INFO_BYTES_ACKED + 8 else None


class AiohttpSocket:
    """An aiohttp WebSocket as a `Connection` (stream/driver.py), with a keepalive that counts what the peer reads.

    aiohttp's own heartbeat closes a socket whose pong is late; a listener that reads audio as it plays has
    megabytes of it in the socket buffers ahead of the ping, so its pong came a minute late and the socket was cut
    (found by a probe). Here (`ws` made with `heartbeat=None, autoping=False`) any frame from the peer, any send
    that completes and (Linux) any byte the peer's TCP acknowledged since the last look (`tcp_acked`: it has read
    some) count as signs of life: after `heartbeat_s` without one the socket pings, after 1.5 x `heartbeat_s` it
    is aborted (a peer that neither reads nor answers), and the session ends its contexts."""

    def __init__(self, ws: web.WebSocketResponse, heartbeat_s: float | None = None,
                 transport: asyncio.BaseTransport | None = None):
        self.ws = ws
        self.heartbeat_s, self._transport = heartbeat_s, transport
        self._alive_at = asyncio.get_running_loop().time()
        self._keepalive: asyncio.Task | None = None
        self._ping: asyncio.Task | None = None
        self._acked: int | None = None

    def _alive(self) -> None:
        self._alive_at = asyncio.get_running_loop().time()

    async def receive(self) -> str | bytes | None:
        if self.heartbeat_s is not None and self._keepalive is None:
            self._keepalive = asyncio.create_task(self._keep_alive(), name="ws-keepalive")
        while True:
            msg = await self.ws.receive()
            self._alive()
            if msg.type == WSMsgType.PING:  # autoping is off: answer it here
                await self.ws.pong(msg.data)
                continue
            if msg.type == WSMsgType.PONG:
                continue
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                return msg.data
            if msg.type == WSMsgType.ERROR:  # e.g. over max_msg_size: aiohttp closed it with 1009
                log.info("websocket closed with an error: %s", self.ws.exception())
            return None  # CLOSE / CLOSING / CLOSED / ERROR

    async def _keep_alive(self) -> None:
        beat = self.heartbeat_s
        loop = asyncio.get_running_loop()
        while not self.ws.closed:
            await asyncio.sleep(beat / 4)  # a timer: the keepalive's own clock
            acked = tcp_acked(self._transport)
            if acked is not None and acked != self._acked:
                self._acked = acked
                self._alive()
            quiet = loop.time() - self._alive_at
            if quiet >= 1.5 * beat:
                log.info("websocket peer neither read nor answered for %.1f s: aborted", quiet)
                if self._transport is not None:
                    self._transport.abort()  # receive() returns None, a blocked send fails: the session ends
                return
            if quiet >= beat and self._ping is None:
                self._ping = asyncio.create_task(self._send_ping())

    async def _send_ping(self) -> None:
        try:
            await self.ws.ping()
        except (ConnectionError, RuntimeError) as e:  # closing: the session sees it too
            log.debug("websocket ping failed: %r", e)
        finally:
            self._ping = None

    async def send_text(self, text: str) -> None:
        await self.ws.send_str(text)
        self._alive()

    async def send_bytes(self, data: bytes) -> None:
        await self.ws.send_bytes(data)
        self._alive()

    async def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        for task in (self._keepalive, self._ping):
            if task is not None:
                task.cancel()
        if not self.ws.closed:
            await self.ws.close(code=code, message=reason.encode())


# ---------------------------------------------------------------- handlers

async def ws_stream(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    view = request_view(request)
    refusal = websocket_refusal(state, view)  # cross-site WebSocket hijacking: no upgrade
    if refusal is not None:
        return await respond(request, refusal)
    cfg = state.config
    # writer_limit: how much it writes between looks at the transport's flow control (aiohttp's 256 KiB: 5 s of
    # audio waited in the process for a client that stopped reading, beside the kernel's send buffer)
    limit = {} if cfg.send_buffer_bytes is None else {"writer_limit": cfg.send_buffer_bytes}
    ws = web.WebSocketResponse(heartbeat=None, autoping=False, max_msg_size=cfg.hard_message_bytes, compress=False,
                               **limit)
    await ws.prepare(request)
    await run_websocket(state, view, AiohttpSocket(ws, cfg.heartbeat_s, request.transport))
    return ws


async def http_speech(request: web.Request) -> web.StreamResponse:
    return await respond(request, await speech(request.app[STATE], request_view(request)))


async def healthz(request: web.Request) -> web.Response:
    return await respond(request, routes.healthz(request.app[STATE]))


async def metrics(request: web.Request) -> web.Response:
    return await respond(request, routes.metrics(request.app[STATE]))


async def voices(request: web.Request) -> web.Response:
    return await respond(request, routes.voices(request.app[STATE], request_view(request)))


async def cors_preflight(request: web.Request) -> web.Response:
    return await respond(request, routes.preflight(request.app[STATE], request_view(request)))


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: a listed origin may read the response (also a streamed body or an error)."""
    for name, value in routes.cors_headers(request.app[STATE], request_view(request)).items():
        if name == "Vary":
            response.headers.add(name, value)
        else:
            response.headers[name] = value


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """A handler's unexpected failure, an unknown path and a wrong method are JSON errors
    (stream/routes.py), never aiohttp's text/plain page."""
    state = request.app[STATE]
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return await respond(request, routes.not_found(state, request_view(request)))
    except web.HTTPMethodNotAllowed as e:
        return await respond(request, routes.method_not_allowed(state, request_view(request), list(e.allowed_methods)))
    except (web.HTTPException, ConnectionError):
        raise
    except Exception:
        return await respond(request, routes.internal_error(state, request_view(request)))


# ---------------------------------------------------------------- app

class BadRequestLines(logging.Filter):
    """aiohttp answers a request it cannot parse (a line over 8190 bytes, a bad method or URL, not HTTP at all) with
    its 400 and logs it at ERROR with a traceback: from the open internet, noise a scanner can fill a log with. Such
    records become one INFO line (the error named); every other record passes as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, http_exceptions.HttpProcessingError):
            record.msg = f"{record.msg}: {type(exc).__name__} ({exc.code})"
            record.levelno, record.levelname, record.exc_info, record.exc_text = logging.INFO, "INFO", None, None
        return True


def quiet_bad_requests() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, BadRequestLines) for f in server_log.filters):
        server_log.addFilter(BadRequestLines())


def make_app(state: ServerState, trace_out: str | None = None, profile_out: str | None = None) -> web.Application:
    """The app on one port. Run it with `handler_cancellation=True` (see `serve`). `trace_out`: record
    the pipeline's trace and write it there at shutdown (`serve --trace-out`); `profile_out`: sample every
    thread's stack from start-up to clean-up and write the profile there (`serve --profile-out`)."""
    app = web.Application(client_max_size=state.config.hard_message_bytes, middlewares=[json_errors])
    quiet_bad_requests()
    app[STATE] = state
    app.router.add_get("/v1/tts/stream", ws_stream)
    app.router.add_post("/v1/audio/speech", http_speech)
    app.router.add_get("/v1/voices", voices)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    for path in CORS_ROUTES:
        app.router.add_route("OPTIONS", path, cors_preflight)
    app.on_response_prepare.append(add_cors_headers)

    async def drain_streams(app: web.Application) -> None:  # the runner's cleanup: what `serve_until_signalled` has
        # not drained (a second signal cut its drain short: what is open ends now), or all of it (a caller's own
        # `cleanup()`)
        await drain(state, 0.0 if state.pipeline.draining else state.config.drain_s)

    app.on_shutdown.append(drain_streams)  # first: WebRTC's peers (closed next) drain like the WebSockets
    _mount_webrtc(app, state)

    def serve_file(path):
        async def handler(request: web.Request) -> web.FileResponse:
            return web.FileResponse(path)
        return handler

    for url, path in routes.demo_files(routes.web_dir()).items():
        app.router.add_get(url, serve_file(path))

    async def start(app: web.Application) -> None:
        await start_pipeline(state)

    async def stop(app: web.Application) -> None:
        await state.pipeline.stop()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    if profile_out:
        async def profiled(app: web.Application):
            sampler = StackSampler()
            sampler.start()
            yield
            await asyncio.to_thread(write_profile, sampler.stop(), profile_out)

        app.cleanup_ctx.append(profiled)
    if trace_out:
        _record_trace(app, state.pipeline, trace_out)
    return app


def _mount_webrtc(app: web.Application, state: ServerState) -> None:
    try:
        from higgs_stream.stream import webrtc
    except ImportError as e:  # aiortc/av are an optional extra
        log.info("WebRTC disabled (%s); install higgs-stream[webrtc] for POST /v1/webrtc/offer", e)
        return
    add_routes = getattr(webrtc, "add_routes", None)
    if add_routes is None:
        log.warning("higgs_stream.stream.webrtc has no add_routes(app, state); WebRTC not mounted")
        return
    add_routes(app, state)


async def serve(state: ServerState, host: str, port: int, trace_out: str | None = None,
                profile_out: str | None = None) -> web.AppRunner:
    """Start the app (returns the runner; `await runner.cleanup()` stops it). Port 0 = any free port."""
    runner = web.AppRunner(make_app(state, trace_out, profile_out), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        for sock in listening_sockets(host, port, state.config.send_buffer_bytes):
            await web.SockSite(runner, sock).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def bound_port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_at_once(signum: int, frame=None) -> None:
    """A signal's handler while nothing can be drained (the model loading, the warm-up) or once a drain is over (the
    clean-up): one line, then the process ends now with 128 + the signal. Python's own default, a KeyboardInterrupt
    in the middle of the warm-up, aborted the process with a C++ "terminate called" (exit 134, a probe)."""
    name = signal.Signals(signum).name
    sys.stderr.write(f"higgs-stream serve: {name}: stopping now (nothing is being served)\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def exit_on_signals() -> None:
    """`exit_at_once` for SIGINT and SIGTERM (main thread only: signal handlers live there)."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, exit_at_once)


async def serve_until_signalled(state: ServerState, host: str, port: int, trace_out: str | None = None,
                                profile_out: str | None = None) -> None:
    """`serve`: the app on host:port until SIGTERM / SIGINT, then a drain (`driver.drain`) while it still listens and
    reads every connection (new streams get `shutting_down`, `/healthz` 503 "draining", an open context's `end` or
    `cancel` is heard), then the runner's cleanup. Not the cleanup alone: it stops listening and stops reading the open
    connections first (aiohttp's `pre_shutdown`), so a context whose `end` came during the drain ran out its time and
    failed (a probe). A second signal cuts the drain short (what is open ends with `shutting_down` at once). The
    caller has `exit_on_signals` in force from before the model loads (serve_command.run): a signal during the
    start-up ends the process at once, as one during the clean-up does. ConfigError when it cannot listen there."""
    try:
        runner = await serve(state, host, port, trace_out, profile_out)
    except OSError as e:  # the port was taken while the model loaded
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    log.info("%s", startup_line(runner.app, host, bound_port(runner)))
    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[int] = asyncio.Queue()  # each one counts: two sent back to back are two
    for signum in SIGNALS:
        loop.add_signal_handler(signum, signals.put_nowait, signum)
    try:
        await signals.get()
        log.info("shutting down (a second signal stops at once)")
        draining = asyncio.ensure_future(drain(state, state.config.drain_s))
        second = asyncio.ensure_future(signals.get())
        await asyncio.wait({draining, second}, return_when=asyncio.FIRST_COMPLETED)
        for task in (draining, second):
            task.cancel()
        if not draining.cancelled() and draining.done():
            draining.result()  # a drain that failed says why
        elif second.done():
            log.warning("a second signal: the drain is cut short")
    finally:
        for signum in SIGNALS:
            loop.remove_signal_handler(signum)
        exit_on_signals()  # a third signal: whatever the clean-up waits for, the process ends
        await runner.cleanup()


def _record_trace(app: web.Application, pipeline: Pipeline, path: str) -> None:
    """`--trace-out`: the pipeline's and codec worker's trace (monotonic seconds), written at shutdown."""
    pipeline.trace = pipeline.codec_worker.trace = []

    def dump() -> None:
        with open(path, "w") as f:
            json.dump({"clock": "monotonic", "events": pipeline.trace}, f)

    async def write(app: web.Application) -> None:
        await asyncio.to_thread(dump)
        log.info("trace: %d events written to %s", len(pipeline.trace), path)

    app.on_cleanup.append(write)


def startup_line(app: web.Application, host: str, port: int) -> str:
    """What `serve` logs once it listens: the address and the transports mounted."""
    paths = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    webrtc = ", WebRTC POST /v1/webrtc/offer" if "/v1/webrtc/offer" in paths else ", no WebRTC"
    return f"serving on http://{host}:{port} (WebSocket /v1/tts/stream, POST /v1/audio/speech{webrtc})"
