"""What every HTTP route and WebSocket upgrade checks before it does any work (stream/PROTOCOL.md
§0, §3): the browser Origin, the bearer token, the JSON content type, the body's size and arrival
time; and how a refused or failed request is answered: the JSON error body with its status
(`error_response`), also for a handler's unexpected failure, an unknown path or a wrong method
(`json_errors`); and CORS for the origins listed in `cors_origins` (`cors_preflight`, `add_cors_headers`)."""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web
from higgs_stream.engine.errors import HiggsStreamError, NotFoundError
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.errors import (
    ForbiddenOriginError,
    MethodNotAllowedError,
    RequestTimeoutError,
    TooLargeError,
    UnauthorizedError,
    UnsupportedMediaTypeError,
)
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.server_state import STATE

log = logging.getLogger(__name__)

HTTP_STATUS = {"bad_json": 400, "unknown_type": 400, "invalid_input": 400, "bad_config": 400, "not_found": 400,
               "bad_audio": 400, "too_large": 413, "busy": 503, "unauthorized": 401, "forbidden_origin": 403,
               "unsupported_media_type": 415, "timeout": 408, "method_not_allowed": 405}
# Routes a page on a `cors_origins` origin may call, and the methods they serve.
CORS_ROUTES = {"/v1/audio/speech": "POST", "/v1/voices": "GET"}


def authorized(request: web.Request, token: str | None) -> bool:
    if token is None:
        return True
    header = request.headers.get("Authorization", "")
    candidates = [header[7:].strip()] if header[:7].lower() == "bearer " else []
    candidates += request.query.getall("token", [])
    # Header bytes that are not UTF-8 arrive as surrogates; "surrogatepass" encodes any string, and
    # never to the bytes of a real (UTF-8) token.
    want = token.encode()
    return any(hmac.compare_digest(c.encode("utf-8", "surrogatepass"), want) for c in candidates)


def origin_allowed(request: web.Request, allowed: tuple[str, ...]) -> bool:
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


def check_origin(request: web.Request, cfg: ServerConfig) -> None:
    """ForbiddenOriginError for a browser request from an origin that is not allowed."""
    if not origin_allowed(request, cfg.browser_origins):
        raise ForbiddenOriginError(f"origin {request.headers.get('Origin', '')[:200]!r} is not allowed "
                                   f"(see --allow-origin, --cors-origin)")


def check_request(request: web.Request, cfg: ServerConfig, json_body: bool = False) -> None:
    """Origin, token and (for POST routes) the JSON content type; raises the typed error."""
    check_origin(request, cfg)
    if not authorized(request, cfg.token):
        raise UnauthorizedError("wrong or missing token")
    if json_body and request.content_type != "application/json":
        # A cross-site page can post text/plain or a form without asking first; not JSON.
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, got {request.content_type!r}")


async def read_body(request: web.Request, cfg: ServerConfig) -> bytes:
    """The request body, within `http_body_timeout_s` and `hard_message_bytes`."""
    try:
        async with asyncio.timeout(cfg.http_body_timeout_s):
            return await request.read()
    except TimeoutError:
        raise RequestTimeoutError(f"request body not received within {cfg.http_body_timeout_s:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise TooLargeError(f"request body over {cfg.hard_message_bytes} bytes") from None


def error_response(error: HiggsStreamError, metrics: Metrics, status: int | None = None) -> web.Response:
    metrics.errors.inc(code=error.code)
    status = status or HTTP_STATUS.get(error.code, 500)
    body = {"error": {"message": str(error), "type": "invalid_request_error" if status < 500 else "server_error",
                      "code": error.code, "param": None}}
    headers = {"Retry-After": "1"} if status == 503 else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """A handler's unexpected failure is logged with its traceback and answered as a JSON
    `internal` error (500), an unknown path as `not_found` (404), a wrong method as
    `method_not_allowed` (405, with `Allow`); never aiohttp's text/plain page."""
    metrics = request.app[STATE].metrics
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error_response(NotFoundError(f"no route {request.path[:200]!r}"), metrics, status=404)
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        response = error_response(MethodNotAllowedError(
            f"{request.method[:20]} is not allowed on {request.path[:200]!r}; use {allowed}"), metrics)
        response.headers["Allow"] = allowed
        return response
    except (web.HTTPException, ConnectionError):
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(HiggsStreamError("internal server error"), metrics)


def cors_origin(request: web.Request, cfg: ServerConfig) -> str | None:
    """The request's Origin when it is listed in `cors_origins` and the path is a CORS route."""
    origin = request.headers.get("Origin")
    if origin is None or request.path not in CORS_ROUTES:
        return None
    return origin if origin.strip().lower() in (o.lower() for o in cfg.cors_origins) else None


async def cors_preflight(request: web.Request) -> web.Response:
    """OPTIONS on a CORS route: 204 with the Access-Control headers for a listed origin (no token
    needed: browsers send none on a preflight), else `403 forbidden_origin`."""
    state = request.app[STATE]
    origin = cors_origin(request, state.config)
    if origin is None:
        return error_response(ForbiddenOriginError(
            f"origin {request.headers.get('Origin', '')[:200]!r} is not allowed cross-origin (see --cors-origin)"),
            state.metrics)
    return web.Response(status=204, headers={
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": f"{CORS_ROUTES[request.path]}, OPTIONS",
        "Access-Control-Allow-Headers": "Authorization, Content-Type",
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    })


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: a listed origin may read the response (also a streamed body or an
    error), and its `Retry-After`."""
    if request.method == "OPTIONS":
        return
    origin = cors_origin(request, request.app[STATE].config)
    if origin is not None:
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = "Retry-After"
        response.headers.add("Vary", "Origin")
