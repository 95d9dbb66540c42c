"""Typed errors. Every failure a user can cause maps to one of these, with a stable `code`."""


class HiggsStreamError(Exception):
    """Base class: `code` is the stable machine-readable error code sent to clients."""

    code = "internal"


class ConfigError(HiggsStreamError):
    code = "bad_config"


class CheckpointError(HiggsStreamError):
    code = "checkpoint"


class InvalidInputError(HiggsStreamError):
    code = "invalid_input"


class AudioInputError(HiggsStreamError):
    code = "bad_audio"


class CapacityError(HiggsStreamError):
    code = "busy"


class NotFoundError(HiggsStreamError):
    code = "not_found"


class CancelledStream(HiggsStreamError):
    code = "cancelled"
