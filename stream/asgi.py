"""The ASGI app (Starlette): the routes of the aiohttp server over ASGI, what Ray Serve's proxy
speaks (stream/ray_app.py) and what any ASGI server runs (`serve_asgi`: uvicorn, in process).

A thin adapter like stream/server.py: what each route does is written once (stream/routes.py,
stream/http_speech.py, stream/driver.py); here an ASGI scope becomes a `Request`, a reply becomes
ASGI messages and a WebSocket a `Connection`. Every handler watches its peer while it writes: a
streamed HTTP body is produced beside a task that waits for `http.disconnect`, the WebSocket
session runs a reader beside its writer. Behind Serve's proxy this is the only way a handler
learns that its client left (sends never fail there; scaleout.md §2.2). Every failure ends as a
JSON error or a typed WebSocket error; nothing escapes to the server's "Exception in ASGI
application" page. WebRTC is not mounted here: it stays on the aiohttp server (README, Scale-out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as StarletteRequest
from starlette.responses import FileResponse, Response
from starlette.routing import Route, WebSocketRoute

from higgs_stream.engine.errors import HiggsStreamError
from higgs_stream.stream import routes
from higgs_stream.stream.driver import CLOSE_NORMAL, CLOSE_TOO_BIG, drain, run_websocket, websocket_refusal
from higgs_stream.stream.errors import BadJsonError, TooLargeError
from higgs_stream.stream.guards import CORS_ROUTES
from higgs_stream.stream.http_speech import speech
from higgs_stream.stream.routes import Reply, Request, StreamAborted, StreamReply
from higgs_stream.stream.server_state import ServerState, listening_sockets, start_pipeline

log = logging.getLogger(__name__)

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


# ---------------------------------------------------------------- ASGI <-> routes

def request_view(scope: Scope, receive: Receive | None = None, limit: int = 0) -> Request:
    """The framework-neutral view of an ASGI scope. Header values are decoded as UTF-8 with
    surrogates for other bytes (as aiohttp does); the body is read within `limit` bytes."""
    headers = [(k.decode("latin-1"), v.decode("utf-8", "surrogateescape")) for k, v in scope.get("headers", [])]
    query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True,
                      encoding="utf-8", errors="surrogateescape")
    host = next((v for k, v in headers if k.lower() == "host"), None)
    if host is None and scope.get("server"):
        host = f"{scope['server'][0]}:{scope['server'][1]}"

    encoding = next((v.strip().lower() for k, v in headers if k.lower() == "content-encoding"), "")

    async def read() -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ConnectionError("the client left before its request body arrived")
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                raise TooLargeError(f"request body over {limit} bytes")
            chunks.append(body)
            if not message.get("more_body", False):
                return decoded(b"".join(chunks), encoding, limit)

    return Request.build(scope.get("method", "GET"), scope.get("path", "/"), headers, query, host or "",
                         read if receive is not None else None)


ZLIB_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decoded(body: bytes, encoding: str, limit: int) -> bytes:
    """A request body by its Content-Encoding, as aiohttp's server reads one (uvicorn passes the bytes on): gzip and
    deflate decompressed within `limit` bytes (TooLargeError past it: a small bomb is no large body either), a body
    they cannot decode a BadJsonError; any other encoding as it came."""
    wbits = ZLIB_WBITS.get(encoding)
    if wbits is None or not body:
        return body
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise BadJsonError(f"request body could not be read: {encoding}: {e}") from None
    if len(out) > limit:
        raise TooLargeError(f"request body over {limit} bytes once decompressed")
    return out  # a stream cut short gives what it holds, as aiohttp's (its JSON is then incomplete: bad_json)


def _raw_headers(headers: dict[str, str], content_type: str = "", length: int | None = None) -> list[tuple[bytes, bytes]]:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if content_type:
        raw.append((b"content-type", content_type.encode("latin-1")))
    if length is not None:
        raw.append((b"content-length", str(length).encode()))
    return raw


async def send_reply(reply: Reply, send: Send) -> None:
    await send({"type": "http.response.start", "status": reply.status,
                "headers": _raw_headers(reply.headers, reply.content_type, len(reply.body))})
    await send({"type": "http.response.body", "body": reply.body})


async def send_stream(reply: StreamReply, receive: Receive, send: Send) -> None:
    """Write a StreamReply as it is produced, beside a watcher of the client: when the client
    leaves, production stops (the chunks are cancelled where they wait) and the reply is closed."""

    left = asyncio.Event()

    async def produce() -> None:
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": _raw_headers(reply.headers, reply.content_type)})
        try:
            async for chunk in reply.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                # uvicorn's send returns at once once the client has gone, and with the audio all queued nothing
                # here waits: without a turn for the watcher the stream would run to its end, counted completed
                await asyncio.sleep(0)
                if left.is_set():
                    return
        except StreamAborted:
            return  # no final chunk: the server closes the connection, the client sees a truncated body
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def client_left() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        left.set()

    producer = asyncio.create_task(produce(), name="http-stream")
    watcher = asyncio.create_task(client_left(), name="http-watch")
    try:
        await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (producer, watcher):
            task.cancel()
        results = await asyncio.gather(producer, watcher, return_exceptions=True)
        await reply.close()
    failure = next((r for r in results if isinstance(r, BaseException)
                    and not isinstance(r, (asyncio.CancelledError, ConnectionError, OSError))), None)
    if failure is not None:
        raise failure


class AsgiSocket:
    """An ASGI WebSocket (after `websocket.accept`) as a `Connection` (stream/driver.py)."""

    def __init__(self, receive: Receive, send: Send, limit: int):
        self._receive, self._send, self._limit = receive, send, limit
        self._closed = False

    async def receive(self) -> str | bytes | None:
        if self._closed:
            return None
        message = await self._receive()
        if message["type"] != "websocket.receive":  # websocket.disconnect
            self._closed = True
            return None
        data = message.get("text")
        if data is None:
            data = message.get("bytes") or b""
        size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
        if size > self._limit:  # the ASGI server may allow more than our hard limit (Serve's proxy: 16 MiB)
            await self.close(CLOSE_TOO_BIG, "message too big")
            return None
        return data

    async def send_text(self, text: str) -> None:
        await self._emit({"type": "websocket.send", "text": text})

    async def send_bytes(self, data: bytes) -> None:
        await self._emit({"type": "websocket.send", "bytes": bytes(data)})

    async def close(self, code: int = CLOSE_NORMAL, reason: str = "") -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._send({"type": "websocket.close", "code": code, "reason": reason})
        except (OSError, RuntimeError):  # the peer is gone already
            pass

    async def _emit(self, message: dict) -> None:
        if self._closed:
            raise ConnectionError("websocket closed")
        try:
            await self._send(message)
        except (OSError, RuntimeError) as e:  # uvicorn: ClientDisconnected (an OSError), or a send after close
            self._closed = True
            raise ConnectionError(f"websocket send failed: {e!r}") from e


# ---------------------------------------------------------------- endpoints

class _Endpoint:
    """One path: its handlers by method (an ASGI app; Starlette answers other methods with 405)."""

    def __init__(self, state: ServerState, handlers: dict[str, Callable[[Request], Awaitable[Reply | StreamReply]]]):
        self.state, self.handlers = state, handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = request_view(scope, receive, self.state.config.hard_message_bytes)
        method = "GET" if request.method == "HEAD" else request.method
        try:
            reply = await self.handlers[method](request)
        except ConnectionError:
            return  # the client left before its request was read
        except Exception:
            reply = routes.internal_error(self.state, request)
        if isinstance(reply, StreamReply):
            await send_stream(reply, receive, send)
        else:
            await send_reply(reply, send)


class _WebSocketEndpoint:
    def __init__(self, state: ServerState):
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = request_view(scope)
        if (await receive())["type"] != "websocket.connect":
            return
        refusal = websocket_refusal(self.state, request)  # cross-site WebSocket hijacking: no upgrade
        if refusal is not None:
            if "websocket.http.response" in scope.get("extensions", {}):
                await send({"type": "websocket.http.response.start", "status": refusal.status,
                            "headers": _raw_headers(refusal.headers, refusal.content_type, len(refusal.body))})
                await send({"type": "websocket.http.response.body", "body": refusal.body})
            else:  # the server answers 403 itself
                await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "websocket.accept"})
        await run_websocket(self.state, request, AsgiSocket(receive, send, self.state.config.hard_message_bytes))


def _file(path) -> Callable:
    async def endpoint(request: StarletteRequest) -> Response:
        return FileResponse(path)
    return endpoint


class _Cors:
    """Every response of a CORS route to a listed origin carries the Access-Control headers."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        extra = {}
        if scope["type"] == "http" and scope.get("path") in CORS_ROUTES:
            extra = routes.cors_headers(self.state, request_view(scope))
        if not extra:
            return await self.app(scope, receive, send)

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_raw_headers(extra)]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def make_asgi_app(state: ServerState, drain_s: float | None = None):
    """The app: the aiohttp server's routes (without WebRTC). Its lifespan starts the pipeline and, at shutdown,
    drains (`driver.drain`: for `drain_s`, default the config's `drain_s`; then every WebSocket closes with 1001) and
    stops the pipeline."""

    async def speech_route(request: Request) -> Reply | StreamReply:
        return await speech(state, request)

    async def preflight(request: Request) -> Reply:
        return routes.preflight(state, request)

    async def voices(request: Request) -> Reply:
        return routes.voices(state, request)

    async def healthz(request: Request) -> Reply:
        return routes.healthz(state)

    async def metrics(request: Request) -> Reply:
        return routes.metrics(state)

    table = [
        Route("/v1/audio/speech", _Endpoint(state, {"POST": speech_route, "OPTIONS": preflight}),
              methods=["POST", "OPTIONS"]),
        Route("/v1/voices", _Endpoint(state, {"GET": voices, "OPTIONS": preflight}), methods=["GET", "OPTIONS"]),
        Route("/healthz", _Endpoint(state, {"GET": healthz}), methods=["GET"]),
        Route("/metrics", _Endpoint(state, {"GET": metrics}), methods=["GET"]),
        WebSocketRoute("/v1/tts/stream", _WebSocketEndpoint(state)),
    ]
    table += [Route(url, _file(path), methods=["GET"]) for url, path in routes.demo_files(routes.web_dir()).items()]

    async def not_found(request: StarletteRequest, exc: HTTPException) -> Response:
        return _response(routes.not_found(state, request_view(request.scope)))

    async def wrong_method(request: StarletteRequest, exc: HTTPException) -> Response:
        allowed = [m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip()]
        return _response(routes.method_not_allowed(state, request_view(request.scope), allowed))

    @contextlib.asynccontextmanager
    async def lifespan(app) -> AsyncIterator[None]:
        await start_pipeline(state)
        try:
            yield
        finally:
            await drain(state, state.config.drain_s if drain_s is None else drain_s)
            await state.pipeline.stop()

    app = Starlette(routes=table, exception_handlers={404: not_found, 405: wrong_method}, lifespan=lifespan)
    return _Cors(app, state)


def _response(reply: Reply) -> Response:
    return Response(reply.body, status_code=reply.status, headers=reply.headers, media_type=reply.content_type or None)


# ---------------------------------------------------------------- serving it in process (uvicorn)

class AsgiServer:
    """The ASGI app on uvicorn in this event loop: `await AsgiServer(state).start(host, port)`,
    `port`, `await cleanup()` (drains: `driver.drain`, then stops uvicorn and the pipeline)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.port = 0
        self._server = None
        self._task: asyncio.Task | None = None

    async def start(self, host: str, port: int, timeout_s: float = 60.0) -> AsgiServer:
        import uvicorn

        cfg = self.state.config
        config = uvicorn.Config(make_asgi_app(self.state), lifespan="on", log_config=None, access_log=False,
                                ws_max_size=cfg.hard_message_bytes, ws_per_message_deflate=False,
                                ws_ping_interval=cfg.heartbeat_s, ws_ping_timeout=cfg.heartbeat_s,
                                timeout_graceful_shutdown=5)
        socks = listening_sockets(host, port, cfg.send_buffer_bytes)
        self.port = socks[0].getsockname()[1]
        self._server = uvicorn.Server(config)
        self._server.capture_signals = contextlib.nullcontext  # the caller owns the signals
        self._task = asyncio.create_task(self._server.serve(sockets=socks), name="uvicorn")
        async with asyncio.timeout(timeout_s):
            while not self._server.started:
                if self._task.done():
                    self._task.result()  # startup failed: raise why
                    raise HiggsStreamError("the ASGI server stopped during startup")
                await asyncio.sleep(0.01)
        return self

    async def cleanup(self, timeout_s: float = 30.0) -> None:
        if self._task is None:
            return
        await drain(self.state, self.state.config.drain_s)
        self._server.should_exit = True
        async with asyncio.timeout(timeout_s):
            await self._task
        self._task = None


async def serve_asgi(state: ServerState, host: str, port: int) -> AsgiServer:
    """Start the ASGI app on uvicorn (port 0 = any free port); `await server.cleanup()` stops it."""
    return await AsgiServer(state).start(host, port)
