"""What every HTTP route and WebSocket upgrade checks before it does any work (stream/PROTOCOL.md
§0, §3): the browser Origin, the bearer token, the JSON content type, the body's size and arrival
time; the JSON error body and status of a refused or failed request (`error_reply`); and which
origins get CORS (`cors_origin`, listed in `cors_origins`).

Independent of the web framework: a request is anything with `headers` (case-insensitive),
`query` (a multidict), `host`, `path` and `content_type`, as both stream/routes.py's `Request`
and aiohttp's request are."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from higgs_stream.engine.errors import HiggsStreamError
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.errors import (
    ForbiddenOriginError,
    RequestTimeoutError,
    UnauthorizedError,
    UnsupportedMediaTypeError,
)

HTTP_STATUS = {"bad_json": 400, "unknown_type": 400, "invalid_input": 400, "bad_config": 400, "not_found": 400,
               "bad_audio": 400, "too_large": 413, "busy": 503, "unauthorized": 401, "forbidden_origin": 403,
               "unsupported_media_type": 415, "timeout": 408, "method_not_allowed": 405, "shutting_down": 503}
# Routes a page on a `cors_origins` origin may call, and the methods they serve.
CORS_ROUTES = {"/v1/audio/speech": "POST", "/v1/voices": "GET", "/v1/webrtc/offer": "POST"}


def authorized(request: Any, token: str | None) -> bool:
    if token is None:
        return True
    header = request.headers.get("Authorization", "")
    candidates = [header[7:].strip()] if header[:7].lower() == "bearer " else []
    candidates += request.query.getall("token", [])
    # Header bytes that are not UTF-8 arrive as surrogates; "surrogatepass" encodes any string, and
    # never to the bytes of a real (UTF-8) token.
    want = token.encode()
    return any(hmac.compare_digest(c.encode("utf-8", "surrogatepass"), want) for c in candidates)


def origin_allowed(request: Any, allowed: tuple[str, ...]) -> bool:
    """Requests without an Origin header (not from a browser) pass; a browser's must come from the
    server's own origin (the Origin's host[:port] is the Host header) or an allowed one."""
    origin = request.headers.get("Origin")
    if origin is None or "*" in allowed:
        return True
    origin = origin.strip().lower()
    if origin in (o.lower() for o in allowed):
        return True
    scheme, sep, authority = origin.partition("://")
    return bool(sep) and scheme in ("http", "https") and authority == (request.host or "").lower()


def check_origin(request: Any, cfg: ServerConfig) -> None:
    """ForbiddenOriginError for a browser request from an origin that is not allowed."""
    if not origin_allowed(request, cfg.browser_origins):
        raise ForbiddenOriginError(f"origin {request.headers.get('Origin', '')[:200]!r} is not allowed "
                                   f"(see --allow-origin, --cors-origin)")


def check_request(request: Any, cfg: ServerConfig, json_body: bool = False) -> None:
    """Origin, token and (for POST routes) the JSON content type; raises the typed error."""
    check_origin(request, cfg)
    if not authorized(request, cfg.token):
        raise UnauthorizedError("wrong or missing token")
    if json_body and request.content_type != "application/json":
        # A cross-site page can post text/plain or a form without asking first; not JSON.
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, got {request.content_type!r}")


async def read_body(request: Any, cfg: ServerConfig) -> bytes:
    """The request body within `http_body_timeout_s`; `request.read()` raises TooLargeError past
    `hard_message_bytes` (stream/routes.py's `Request`)."""
    try:
        async with asyncio.timeout(cfg.http_body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise RequestTimeoutError(f"request body not received within {cfg.http_body_timeout_s:g} s") from None


def error_reply(error: HiggsStreamError, status: int | None = None) -> tuple[int, dict, dict[str, str]]:
    """(status, JSON body in OpenAI's shape, headers) answering `error`."""
    status = status or HTTP_STATUS.get(error.code, 500)
    body = {"error": {"message": str(error), "type": "invalid_request_error" if status < 500 else "server_error",
                      "code": error.code, "param": None}}
    headers = {"Retry-After": "1"} if status == 503 else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return status, body, headers


def cors_origin(request: Any, cfg: ServerConfig) -> str | None:
    """The request's Origin when it is listed in `cors_origins` and the path is a CORS route."""
    origin = request.headers.get("Origin")
    if origin is None or request.path not in CORS_ROUTES:
        return None
    return origin if origin.strip().lower() in (o.lower() for o in cfg.cors_origins) else None
