"""HTTP routes independent of the web framework (stream/PROTOCOL.md §0, §2.4, §3).

What a route reads of a request is a `Request`; what it answers is a `Reply` (a whole body) or a
`StreamReply` (a body sent as it is produced). The aiohttp server (stream/server.py) and the ASGI
app (stream/asgi.py, what Ray Serve's proxy speaks) turn their framework's request into a
`Request` and a reply into their framework's response; every route is written once: here, in
stream/http_speech.py (`POST /v1/audio/speech`) and stream/driver.py (the WebSocket).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy

from higgs_stream.engine.errors import HiggsStreamError, NotFoundError
from higgs_stream.stream.errors import ForbiddenOriginError, MethodNotAllowedError
from higgs_stream.stream.guards import CORS_ROUTES, check_request, cors_origin, error_reply

if TYPE_CHECKING:
    from higgs_stream.stream.server_state import ServerState

log = logging.getLogger(__name__)

JSON = "application/json; charset=utf-8"


@dataclass(frozen=True)
class Request:
    """What the routes read of an HTTP request or WebSocket upgrade. `read()` returns the body
    and raises TooLargeError once it passes the server's hard limit (`hard_message_bytes`)."""

    method: str
    path: str
    headers: CIMultiDictProxy[str]
    query: MultiDictProxy[str]
    host: str
    read: Callable[[], Awaitable[bytes]] | None = None

    @staticmethod
    def build(method: str, path: str, headers, query, host: str,
              read: Callable[[], Awaitable[bytes]] | None = None) -> Request:
        """From (name, value) pairs: headers as decoded text, query parameters percent-decoded."""
        return Request(method.upper(), path, CIMultiDictProxy(CIMultiDict(headers)), MultiDictProxy(MultiDict(query)),
                       host, read)

    @property
    def content_type(self) -> str:
        """The media type of the body, lower-case, without parameters (as aiohttp reports it)."""
        raw = self.headers.get("Content-Type", "")
        return raw.split(";", 1)[0].strip().lower() or "application/octet-stream"


@dataclass
class Reply:
    """A whole response."""

    status: int
    body: bytes = b""
    content_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)


class StreamAborted(Exception):
    """Raised by a `StreamReply`'s chunks after a failure: the transport ends the response without
    its final chunk, so the client sees a truncated body (PROTOCOL.md §2)."""


@dataclass
class StreamReply:
    """A response whose body is produced while it is sent. The transport iterates `chunks` (an
    async generator), stops early when the client leaves, then `aclose()`s it and calls
    `on_close()` however the response ended, also when it never started (that is where a stream
    frees its engine pages)."""

    status: int
    content_type: str
    chunks: AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)
    on_close: Callable[[], None] = lambda: None

    async def close(self) -> None:
        try:
            await self.chunks.aclose()
        finally:
            self.on_close()


def json_reply(obj: dict, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    return Reply(status, json.dumps(obj).encode(), JSON, dict(headers or {}))


def failure_reply(error: HiggsStreamError, state: ServerState, status: int | None = None) -> Reply:
    """The JSON error body of PROTOCOL.md §3 with its status (counted in the metrics)."""
    status, body, headers = error_reply(error, status)
    state.metrics.errors.inc(code=error.code)
    return json_reply(body, status, headers)


# ---------------------------------------------------------------- the small routes

def healthz(state: ServerState) -> Reply:
    """`200` while the engine loop is alive and the server is not shutting down ("draining": a load balancer should
    send nobody new), else `503`; with the codec's state (`CodecWorker.health`) and the talker's linears' choice
    (`linear_choices`)."""
    p = state.pipeline
    status = "unhealthy" if not p.healthy else "draining" if p.draining else "ok"
    body = {"status": status, "active_streams": p.active,
            "max_streams": state.config.max_streams, "steps": p.steps, "codec": p.codec_worker.health(),
            "linears": linear_choices(p.engine)}
    return json_reply(body, 200 if status == "ok" else 503)


def linear_choices(engine) -> dict:
    """Which plain linears run on the CUDA-core GEMV (engine/gemv_choice.py, `--bf16-gemv-rows`), per FastTalker
    ("talker", Qwen3-TTS's "code_predictor"): the rows it serves and the weight shapes [N, K] it took ({} off the
    fast path). A card's choice can differ from another's: this says what this process runs."""
    runner = getattr(engine, "runner", None)  # a test's stand-in engine may have none
    choices = runner.gemv_choices() if hasattr(runner, "gemv_choices") else {}
    return {name: c.describe() for name, c in choices.items()}


def metrics(state: ServerState) -> Reply:
    return Reply(200, state.metrics.render().encode(), "text/plain; charset=utf-8", {"X-Prometheus-Format": "0.0.4"})


def voices(state: ServerState, request: Request) -> Reply:
    try:
        check_request(request, state.config)
    except HiggsStreamError as e:
        return failure_reply(e, state)
    return json_reply(state.voices.describe())


def preflight(state: ServerState, request: Request) -> Reply:
    """OPTIONS on a CORS route: 204 with the Access-Control headers for a listed origin (no token
    needed: browsers send none on a preflight), else `403 forbidden_origin`."""
    origin = cors_origin(request, state.config)
    if origin is None:
        return failure_reply(ForbiddenOriginError(
            f"origin {request.headers.get('Origin', '')[:200]!r} is not allowed cross-origin (see --cors-origin)"), state)
    return Reply(204, content_type="", headers={
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": f"{CORS_ROUTES[request.path]}, OPTIONS",
        "Access-Control-Allow-Headers": "Authorization, Content-Type",
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    })


def cors_headers(state: ServerState, request: Request) -> dict[str, str]:
    """Headers every response of a CORS route carries for a listed origin (the audio, streamed or
    not, and JSON errors): the page may read it and its `Retry-After`. None for other requests."""
    if request.method == "OPTIONS":
        return {}
    origin = cors_origin(request, state.config)
    if origin is None:
        return {}
    return {"Access-Control-Allow-Origin": origin, "Access-Control-Expose-Headers": "Retry-After", "Vary": "Origin"}


def not_found(state: ServerState, request: Request) -> Reply:
    return failure_reply(NotFoundError(f"no route {request.path[:200]!r}"), state, status=404)


def method_not_allowed(state: ServerState, request: Request, allowed: list[str]) -> Reply:
    allow = ", ".join(sorted(allowed))
    reply = failure_reply(MethodNotAllowedError(
        f"{request.method[:20]} is not allowed on {request.path[:200]!r}; use {allow}"), state)
    reply.headers["Allow"] = allow
    return reply


def internal_error(state: ServerState, request: Request) -> Reply:
    """A handler's unexpected failure (call inside `except`): logged with its traceback, answered
    as a JSON `internal` error, never a framework's text/plain page."""
    log.exception("%s %s failed", request.method[:20], request.path[:200])
    return failure_reply(HiggsStreamError("internal server error"), state)


# ---------------------------------------------------------------- the browser demo

def web_dir() -> Path | None:
    """The browser demo's folder inside the installed `higgs_stream.clients` package (if present)."""
    folder = Path(str(resources.files("higgs_stream.clients") / "web"))
    return folder if (folder / "index.html").is_file() else None


def demo_files(folder: Path | None) -> dict[str, Path]:
    """URL path -> file of the (flat) demo folder: `/` is index.html, `/favicon.ico` the SVG icon
    (browsers ask for it whatever the page says), every other file under its own name. One route
    per file, so any other path is the JSON 404."""
    if folder is None:
        log.warning("no browser demo found (higgs_stream.clients/web/index.html); GET / is not served")
        return {}
    files = {"/": folder / "index.html"}
    if (folder / "favicon.svg").is_file():
        files["/favicon.ico"] = folder / "favicon.svg"
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.is_symlink():
            files[f"/{path.name}"] = path
    return files
