"""Typed errors of the streaming service (codes listed in stream/PROTOCOL.md §3)."""

from higgs_stream.engine.errors import HiggsStreamError, InvalidInputError


class BadJsonError(InvalidInputError):
    """A client message is not a JSON object (or is a binary frame where JSON is expected)."""

    code = "bad_json"


class UnknownTypeError(InvalidInputError):
    code = "unknown_type"


class TooLargeError(InvalidInputError):
    code = "too_large"


class UnauthorizedError(HiggsStreamError):
    code = "unauthorized"


class SlowClientError(HiggsStreamError):
    """The client fell more than `stream_buffer_s` of audio behind; its stream was ended."""

    code = "slow_client"


class IdleTimeoutError(HiggsStreamError):
    """A connection sent nothing and had no open context for `idle_timeout_s`; it is closed."""

    code = "idle_timeout"
