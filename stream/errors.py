"""Typed errors of the streaming service (codes listed in stream/PROTOCOL.md §3)."""

import reprlib

from higgs_stream.engine.errors import HiggsStreamError, InvalidInputError


class BadJsonError(InvalidInputError):
    """A client message is not a JSON object (or is a binary frame where JSON is expected)."""

    code = "bad_json"


class UnknownTypeError(InvalidInputError):
    code = "unknown_type"


class TooLargeError(InvalidInputError):
    code = "too_large"


class UnsupportedMediaTypeError(InvalidInputError):
    """An HTTP body that is not `application/json` (a cross-site form or `text/plain` post)."""

    code = "unsupported_media_type"


class MethodNotAllowedError(InvalidInputError):
    """A route asked with a method it does not serve (HTTP 405)."""

    code = "method_not_allowed"


class UnauthorizedError(HiggsStreamError):
    code = "unauthorized"


class ForbiddenOriginError(HiggsStreamError):
    """A browser request from an origin that is neither the server's own nor an allowed one."""

    code = "forbidden_origin"


class SlowClientError(HiggsStreamError):
    """The client did not take its audio: its generation waited `slow_client_s` for it (or `stream_buffer_s` of
    audio queued up); its stream was ended."""

    code = "slow_client"


class IdleTimeoutError(HiggsStreamError):
    """A connection sent nothing and had no open context for `idle_timeout_s` (it is closed), or an
    open context got no message and no audio for `context_idle_s` (it ends)."""

    code = "idle_timeout"


class ShuttingDownError(HiggsStreamError):
    """The server is draining (SIGTERM / SIGINT): it takes no new stream, and a stream still open when the drain
    time (`drain_s`, `serve --drain-timeout`) runs out ends with this."""

    code = "shutting_down"


class RequestTimeoutError(HiggsStreamError):
    """An HTTP request body did not arrive within `http_body_timeout_s`."""

    code = "timeout"


_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxstring, _brief.maxother, _brief.maxlong = 2, 60, 60, 40


def brief(value: object) -> str:
    """A client-sent value for an error message: its repr, bounded in length and depth."""
    return _brief.repr(value)
