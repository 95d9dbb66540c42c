"""Sans-I/O protocol core (stream/PROTOCOL.md §1): the per-connection context state machine and
audio framing. No sockets, no asyncio, no clock: the driver feeds it messages and pipeline events
with `now`, executes the commands it returns, and sends what `outgoing()` yields. What a message
may hold is checked in stream/messages.py; what it does to the contexts is decided here.
"""

from __future__ import annotations

import base64
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from higgs_stream.engine.errors import (
    CapacityError,
    HiggsStreamError,
    InvalidInputError,
    NotFoundError,
)
from higgs_stream.stream.config import PROTOCOL_VERSION, SAMPLE_RATE, ServerConfig
from higgs_stream.stream.errors import (
    BadJsonError,
    IdleTimeoutError,
    TooLargeError,
    UnknownTypeError,
    brief,
)
from higgs_stream.stream.messages import (
    AUDIO_FRAMINGS,
    OPTION_KEYS,
    ContextOptions,
    check_audio_format,
    check_size,
    check_unicode,
    is_int,
    parse_config,
    parse_context_message,
    parse_json,
    parse_options,
    parse_query,
    parse_text,
    parse_voice,
    valid_id,
)
from higgs_stream.stream.text import TextBuffer
from higgs_stream.stream.voices import DEFAULT, Voice, VoiceLibrary

log = logging.getLogger(__name__)

RECENT_DONE = 256  # finished context ids remembered so a late `cancel` is ignored, not an error


# ---- commands the session asks the driver to execute ----

@dataclass(frozen=True)
class Open:
    context_id: str
    options: ContextOptions


@dataclass(frozen=True)
class Speak:
    context_id: str
    text: str


@dataclass(frozen=True)
class Close:
    """No more text for this context: it ends after its last segment."""

    context_id: str


@dataclass(frozen=True)
class Cancel:
    """Stop the context now. `error`: the session ended it with this error (its `error` + `done{reason:"error"}`
    already sent: an idle context), counted as an error, not as the client's cancel."""

    context_id: str
    error: HiggsStreamError | None = None


Command = Open | Speak | Close | Cancel


@dataclass
class _Context:
    id: str
    options: ContextOptions
    given: dict  # option fields of the creating message (later messages must repeat them exactly)
    text: TextBuffer
    chars: int = 0
    ended: bool = False
    audio_started: bool = False
    samples: int = 0
    active_at: float = 0.0  # last message for it, audio or pipeline work (the idle clock)


def _echoable_id(value: object) -> bool:
    """A valid context id that is also valid Unicode (no lone surrogate): an error may carry it back."""
    if not valid_id(value):
        return False
    if value.isascii():  # type: ignore[union-attr]
        return True
    try:
        value.encode("utf-8")  # type: ignore[union-attr]
    except UnicodeEncodeError:
        return False
    return True


class Session:
    """One connection's protocol state. Call `receive`/`tick` with input, execute the returned
    commands in order, report pipeline events with `audio`/`finished`/`reject`, send `outgoing()`.
    """

    def __init__(self, cfg: ServerConfig, voices: VoiceLibrary, query: dict[str, str] | None = None,
                 on_error: Callable[[str], None] | None = None):
        self.cfg = cfg
        self._on_error = on_error
        self.voices = voices
        self.audio_framing = "binary"
        self.max_buffer_delay_ms = cfg.max_buffer_delay_ms
        self._defaults: dict = {}  # option fields set by config (raw JSON values)
        self._default_voice: Voice = voices.resolve(DEFAULT)
        self._contexts: dict[str, _Context] = {}
        self._order: deque[str] = deque()  # live contexts, oldest first: audio goes out in this order
        self._recent: deque[str] = deque(maxlen=RECENT_DONE)
        self._out: list[str | bytes] = []
        if query:
            try:
                self._configure(parse_query(query))
            except HiggsStreamError as e:
                self._error(e)
        self._send({"type": "ready", **self._ready_fields()})

    # ---- inputs ----

    def receive(self, message: str | bytes, now: float) -> list[Command]:
        """One client message. Protocol errors become `error` messages; commands are returned."""
        context_id = None
        try:
            if isinstance(message, bytes):
                check_size(message, self.cfg.max_message_bytes)
                raise BadJsonError("binary messages are not accepted; send JSON text frames")
            msg = parse_json(message, self.cfg.max_message_bytes)
            if _echoable_id(msg.get("context_id")):
                context_id = msg["context_id"]  # echoed in an error only if a strict JSON peer can read it back
            check_unicode(msg, message)
            kind = msg.get("type")
            handler = {"config": self._on_config, "text": self._on_text, "flush": self._on_flush,
                       "end": self._on_end, "cancel": self._on_cancel}.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise UnknownTypeError(f"unknown message type {brief(kind)}; expected config, text, flush, end or cancel")
            existed = context_id in self._contexts
            try:
                return handler(msg, now)
            except Exception:
                if not existed and context_id in self._contexts:  # created, but its Open never returned
                    del self._contexts[context_id]
                    self._order.remove(context_id)
                raise
        except HiggsStreamError as e:
            self._error(e, context_id)
            return []
        except Exception as e:  # a bug: this message fails alone, the session and its contexts go on
            log.exception("session: message failed")
            self._error(HiggsStreamError(f"internal error: {type(e).__name__}"), context_id)
            return []

    def tick(self, now: float) -> list[Command]:
        """Cut text buffers whose idle delay expired."""
        cmds: list[Command] = []
        for ctx in self._contexts.values():
            cmds.extend(Speak(ctx.id, s) for s in ctx.text.poll(now))
        return cmds

    def deadline(self) -> float | None:
        """When `tick` or `idle` next has something to do (None: nothing pending)."""
        times = [t for ctx in self._contexts.values() if (t := ctx.text.deadline()) is not None]
        times += [ctx.active_at + self.cfg.context_idle_s for ctx in self._contexts.values() if not ctx.ended]
        return min(times, default=None)

    def touch(self, context_id: str, now: float) -> None:
        """The pipeline worked on this context at `now` (audio, generation): it is not idle."""
        ctx = self._contexts.get(context_id)
        if ctx is not None:
            ctx.active_at = max(ctx.active_at, now)

    def idle(self, now: float) -> list[str]:
        """Open contexts (no `end` yet) with no message and no activity for `context_idle_s`. The
        driver touches those the pipeline is still working on and times out the others."""
        limit = self.cfg.context_idle_s
        return [ctx.id for ctx in self._contexts.values() if not ctx.ended and now - ctx.active_at >= limit]

    def time_out(self, context_id: str) -> list[Command]:
        """End an idle context: `error{idle_timeout}` + `done{reason:"error"}`; cancel it."""
        ctx = self._contexts[context_id]
        error = IdleTimeoutError(f"context {context_id!r} had no message and no audio for "
                                 f"{self.cfg.context_idle_s:g} s; send `end` when a context is complete")
        self._error(error, context_id)
        self._done(ctx.id, "error")
        return [Cancel(context_id, error)]

    def fail_all(self, error: HiggsStreamError) -> None:
        """The connection is going down on a server failure: every live context ends with `error`."""
        for cid in list(self._order):
            self._error(error, cid)
            self._done(cid, "error")

    def reject(self, context_id: str, error: HiggsStreamError) -> None:
        """The driver could not admit a context it was asked to `Open`: it never existed."""
        assert context_id in self._contexts, f"reject of unknown context {context_id!r}"
        del self._contexts[context_id]
        self._order.remove(context_id)
        self._error(error, context_id)

    def audio(self, context_id: str, pcm: bytes) -> None:
        """Frame PCM (s16le) of the playing context."""
        assert context_id == self.head, f"audio for {context_id!r} while {self.head!r} plays"
        assert len(pcm) % 2 == 0, f"odd PCM byte count {len(pcm)}"
        ctx = self._contexts[context_id]
        if not ctx.audio_started:
            ctx.audio_started = True
            self._send({"type": "audio_start", "context_id": context_id})
        ctx.samples += len(pcm) // 2
        if self.audio_framing == "binary":
            self._out.append(bytes(pcm))
        else:
            self._send({"type": "chunk", "context_id": context_id, "data": base64.b64encode(pcm).decode("ascii")})

    def finished(self, context_id: str, reason: str, error: HiggsStreamError | None = None) -> None:
        """The pipeline ended a context (all its audio was passed to `audio` first)."""
        assert reason in ("completed", "cancelled", "error"), f"bad reason {reason!r}"
        if context_id not in self._contexts:  # already ended by the session (cancel)
            return
        if error is not None:
            self._error(error, context_id)
        self._done(context_id, reason)

    # ---- outputs ----

    @property
    def head(self) -> str | None:
        """The context whose audio is sent now (FIFO by creation), or None."""
        return self._order[0] if self._order else None

    def audio_started(self, context_id: str) -> bool:
        return self._contexts[context_id].audio_started

    @property
    def live(self) -> list[str]:
        return list(self._order)

    def outgoing(self) -> list[str | bytes]:
        out, self._out = self._out, []
        return out

    # ---- message handlers ----

    def _on_config(self, msg: dict, now: float) -> list[Command]:
        self._configure(parse_config(msg))
        self._send({"type": "ready", **self._ready_fields()})
        return []

    def _on_text(self, msg: dict, now: float) -> list[Command]:
        m = parse_text(msg, self.cfg)
        cid, text, given = m.context_id, m.text, m.given
        cmds: list[Command] = []
        ctx = self._contexts.get(cid)
        if ctx is None:
            if len(self._contexts) >= self.cfg.max_contexts:
                raise CapacityError(f"connection has {len(self._contexts)} open contexts, limit {self.cfg.max_contexts}")
            voice = self._default_voice if not ({"voice", "reference"} & set(given)) else None
            options = parse_options({**self._defaults, **given}, self.cfg, self.voices, voice)
            delay = self.max_buffer_delay_ms / 1000
            ctx = _Context(cid, options, given, TextBuffer(self.cfg.max_segment_chars, delay,
                                                             min(delay, self.cfg.sentence_delay_ms / 1000)),
                           active_at=now)
            self._contexts[cid] = ctx
            self._order.append(cid)
            cmds.append(Open(cid, options))
        else:
            if ctx.ended:
                raise InvalidInputError(f"context {brief(cid)} has ended; no more text is accepted")
            if any(ctx.given.get(k, None) != v for k, v in given.items()):
                raise InvalidInputError(f"context {brief(cid)}: options can only be set by its first text message")
        if ctx.chars + len(text) > self.cfg.max_context_chars:
            raise TooLargeError(f"context {brief(cid)} would have {ctx.chars + len(text)} chars, limit {self.cfg.max_context_chars}")
        ctx.chars += len(text)
        ctx.active_at = now
        cmds.extend(Speak(cid, s) for s in ctx.text.append(text, now))
        if m.flush:
            cmds.extend(Speak(cid, s) for s in ctx.text.flush())
        return cmds

    def _on_flush(self, msg: dict, now: float) -> list[Command]:
        cid = parse_context_message(msg)
        if self._finished_recently(cid):
            return []
        ctx = self._live(cid)
        ctx.active_at = now
        return [Speak(ctx.id, s) for s in ctx.text.flush()]

    def _on_end(self, msg: dict, now: float) -> list[Command]:
        cid = parse_context_message(msg)
        if self._finished_recently(cid):  # it failed before the client's end arrived (a probe: `not_found`)
            return []
        ctx = self._live(cid)
        if ctx.ended:
            return []
        ctx.ended = True
        return [*(Speak(ctx.id, s) for s in ctx.text.flush()), Close(ctx.id)]

    def _on_cancel(self, msg: dict, now: float) -> list[Command]:
        cid = parse_context_message(msg)
        if self._finished_recently(cid):
            return []
        self._live(cid)
        self._done(cid, "cancelled")
        return [Cancel(cid)]

    # ---- helpers ----

    def _finished_recently(self, cid: str) -> bool:
        """One of the connection's last RECENT_DONE finished contexts (its `done` sent): its `end`, `flush` or `cancel`
        crossed that `done` (a context failed at once, its client's `end` already on the way) and is ignored."""
        return cid not in self._contexts and cid in self._recent

    def _live(self, cid: str) -> _Context:
        ctx = self._contexts.get(cid)
        if ctx is None:
            raise NotFoundError(f"no open context {brief(cid)}")
        return ctx

    def _configure(self, raw: dict) -> None:
        """Validate a config change completely, then apply it (all or nothing)."""
        check_audio_format(raw)
        framing = raw.get("audio", self.audio_framing) if "audio" in raw else self.audio_framing
        framing = "binary" if framing is None else framing
        if framing not in AUDIO_FRAMINGS:
            raise InvalidInputError(f"audio must be one of {AUDIO_FRAMINGS}, got {brief(framing)}")
        delay = raw.get("max_buffer_delay_ms", self.max_buffer_delay_ms)
        delay = self.cfg.max_buffer_delay_ms if delay is None else delay
        if not is_int(delay) or not 0 <= delay <= 10_000:
            raise InvalidInputError(f"max_buffer_delay_ms must be an int in 0..10000, got {brief(delay)}")
        defaults = dict(self._defaults)
        for key in OPTION_KEYS:
            if key in raw:
                if raw[key] is None:
                    defaults.pop(key, None)
                else:
                    defaults[key] = raw[key]
        if "voice" in raw or "reference" in raw:
            # A new voice replaces the other kind: voice after reference drops the reference.
            if "voice" in raw and "reference" not in raw:
                defaults.pop("reference", None)
            voice = parse_voice(defaults, self.voices) or self.voices.resolve(DEFAULT)
        else:
            voice = self._default_voice
        parse_options(defaults, self.cfg, self.voices, voice)  # validates the other fields
        self._defaults, self._default_voice = defaults, voice
        self.audio_framing, self.max_buffer_delay_ms = framing, delay

    def _ready_fields(self) -> dict:
        return {"protocol": PROTOCOL_VERSION, "sample_rate": SAMPLE_RATE, "encoding": "pcm_s16le",
                "channels": 1, "audio": self.audio_framing, "voice": self._default_voice.name,
                "mode": self._defaults.get("mode", self.cfg.default_mode),
                "max_contexts": self.cfg.max_contexts, "max_buffer_delay_ms": self.max_buffer_delay_ms}

    def _done(self, cid: str, reason: str) -> None:
        ctx = self._contexts.pop(cid)
        self._order.remove(cid)
        self._recent.append(cid)
        self._send({"type": "done", "context_id": cid, "reason": reason, "samples": ctx.samples})

    def _error(self, error: HiggsStreamError, context_id: str | None = None) -> None:
        msg = {"type": "error", "code": error.code, "message": str(error)}
        if context_id is not None:
            msg["context_id"] = context_id
        if self._on_error is not None:
            self._on_error(error.code)
        self._send(msg)

    def _send(self, msg: dict) -> None:
        self._out.append(json.dumps(msg, separators=(",", ":")))
