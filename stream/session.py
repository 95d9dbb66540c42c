"""Sans-I/O protocol core (stream/PROTOCOL.md §1): parses client messages, runs the per-connection
context state machine and frames audio. No sockets, no asyncio, no clock: the driver feeds it
messages and pipeline events with `now`, executes the commands it returns, and sends what
`outgoing()` yields. Also parses the HTTP speech body (§2), which shares the per-context options.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from higgs_stream.engine.errors import CapacityError, HiggsStreamError, InvalidInputError, NotFoundError
from higgs_stream.stream.config import MODES, PROTOCOL_VERSION, SAMPLE_RATE, ServerConfig
from higgs_stream.stream.errors import BadJsonError, IdleTimeoutError, TooLargeError, UnknownTypeError, brief
from higgs_stream.stream.text import TextBuffer
from higgs_stream.stream.voices import DEFAULT, Voice, VoiceLibrary

log = logging.getLogger(__name__)

OPTION_KEYS = ("voice", "reference", "mode", "seed", "temperature", "top_k", "top_p", "scene")
CONFIG_KEYS = (*OPTION_KEYS, "audio", "sample_rate", "encoding", "max_buffer_delay_ms")
AUDIO_FRAMINGS = ("binary", "base64")
MAX_CONTEXT_ID = 128
DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 0.7, 0.95  # Boson's serve engine defaults (engine/request.py)
RECENT_DONE = 256  # finished context ids remembered so a late `cancel` is ignored, not an error
MAX_JSON_DEPTH = 16  # nesting of a client message (the protocol's own messages need 3)


# ---- per-context options (WebSocket and HTTP) ----

@dataclass(frozen=True)
class ContextOptions:
    voice: Voice
    mode: str = "exact"
    seed: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int | None = None
    top_p: float = DEFAULT_TOP_P
    scene: str | None = None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_voice(raw: dict, voices: VoiceLibrary) -> Voice | None:
    """The voice named by `reference` (wins) or `voice` in `raw`; None when neither is given."""
    ref = raw.get("reference")
    if ref is not None:
        if not isinstance(ref, dict) or set(ref) != {"audio", "transcript"}:
            raise InvalidInputError('reference must be {"audio": base64, "transcript": str}')
        return voices.inline(ref["audio"], ref["transcript"])
    name = raw.get("voice")
    if name is None:
        return None
    if isinstance(name, dict) and set(name) == {"id"}:  # OpenAI SDK: voice={"id": ...}
        name = name["id"]
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"voice must be a non-empty string, got {brief(name)}")
    return voices.resolve(name)


def parse_options(raw: dict, cfg: ServerConfig, voices: VoiceLibrary, voice: Voice | None = None) -> ContextOptions:
    """Validate option fields (absent or null = default). `voice` is used when `raw` names none."""
    given = parse_voice(raw, voices)
    voice = given or voice or voices.resolve(DEFAULT)
    def value(key: str, default: Any) -> Any:  # absent or null -> default
        return default if raw.get(key) is None else raw[key]

    mode = value("mode", cfg.default_mode)
    if mode not in MODES:
        raise InvalidInputError(f"mode must be one of {MODES}, got {brief(mode)}")
    seed = raw.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
        raise InvalidInputError(f"seed must be an int in [0, 2**63) or null, got {brief(seed)}")
    temperature = value("temperature", DEFAULT_TEMPERATURE)
    if not _is_number(temperature) or not 0.0 <= temperature <= 2.0:
        raise InvalidInputError(f"temperature must be a number in [0, 2], got {brief(temperature)}")
    top_k = raw.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise InvalidInputError(f"top_k must be an int >= 1 or null, got {brief(top_k)}")
    top_p = value("top_p", DEFAULT_TOP_P)
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidInputError(f"top_p must be a number in (0, 1], got {brief(top_p)}")
    scene = raw.get("scene")
    if scene is not None:
        if not isinstance(scene, str):
            raise InvalidInputError(f"scene must be a string or null, got {type(scene).__name__}")
        if len(scene) > cfg.max_scene_chars:
            raise TooLargeError(f"scene has {len(scene)} chars, limit {cfg.max_scene_chars}")
    return ContextOptions(voice=voice, mode=mode, seed=seed, temperature=float(temperature),
                          top_k=top_k, top_p=float(top_p), scene=scene)


def _valid_id(cid: Any) -> bool:
    return isinstance(cid, str) and 1 <= len(cid) <= MAX_CONTEXT_ID


def _check_fields(msg: dict, allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(msg) - set(allowed))
    if unknown:
        raise InvalidInputError(f"unknown field(s) in {what}: {', '.join(unknown)}")


def _check_audio_format(raw: dict) -> None:
    rate = raw.get("sample_rate")
    if rate is not None and rate != SAMPLE_RATE:
        raise InvalidInputError(f"sample_rate {brief(rate)} is not supported; only {SAMPLE_RATE}")
    encoding = raw.get("encoding")
    if encoding is not None and encoding != "pcm_s16le":
        raise InvalidInputError(f"encoding {brief(encoding)} is not supported; only pcm_s16le")


def parse_json(message: str | bytes, limit: int) -> dict:
    """A JSON object from a client message of at most `limit` bytes, nested at most MAX_JSON_DEPTH
    deep. Whatever a client sends ends here as a typed error: no RecursionError, no ValueError
    (a 5000-digit number), no UnicodeError (bytes that are not UTF-8, a str with lone surrogates)."""
    try:
        size = len(message) if isinstance(message, bytes) else len(message.encode("utf-8"))
        if size > limit:
            raise TooLargeError(f"message of {size} bytes over the limit of {limit}")
        text = message.decode("utf-8") if isinstance(message, bytes) else message
        msg = json.loads(text)
    except UnicodeError as e:
        raise BadJsonError(f"message is not valid UTF-8 text: {e.reason} at {e.start}") from None
    except ValueError as e:  # JSONDecodeError, or an int of more than 4300 digits
        raise BadJsonError(f"message is not valid JSON: {e}") from None
    except RecursionError:
        raise BadJsonError(f"message is nested over {MAX_JSON_DEPTH} deep") from None
    if not isinstance(msg, dict):
        raise BadJsonError(f"message must be a JSON object, got {type(msg).__name__}")
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(msg) > MAX_JSON_DEPTH:
        raise BadJsonError(f"message is nested over {MAX_JSON_DEPTH} deep")
    return msg


def _depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion on hostile input)."""
    deepest, stack = 0, [(obj, 1)]
    while stack and deepest <= MAX_JSON_DEPTH:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def check_unicode(msg: dict, raw: str | bytes) -> None:
    """InvalidInputError when a string of `msg` (parsed from `raw` by `parse_json`) holds a lone
    surrogate: JSON allows the escape "\\ud800", but no tokenizer or UTF-8 peer takes it."""
    if ("\\u" if isinstance(raw, str) else b"\\u") not in raw:
        return  # parse_json refused raw surrogates: only an escape can make one
    stack: list[Any] = [msg]
    while stack:
        node = stack.pop()
        for x in [*node.keys(), *node.values()] if isinstance(node, dict) else node:
            if isinstance(x, str):
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise InvalidInputError(f"strings must be valid Unicode; {brief(x)} holds a lone "
                                            f"surrogate at index {e.start}") from None
            elif isinstance(x, (dict, list)):
                stack.append(x)


# ---- HTTP: POST /v1/audio/speech ----

SPEECH_KEYS = ("input", "model", "voice", "response_format", "stream_format", "speed", "instructions",
               "reference_audio", "reference_text", "seed", "temperature", "top_k", "top_p", "mode",
               "scene", "sample_rate")


@dataclass(frozen=True)
class SpeechRequest:
    input: str
    options: ContextOptions
    response_format: str = "pcm"  # pcm | wav
    stream_format: str = "audio"  # audio | sse


def parse_speech(body: bytes | str, cfg: ServerConfig, voices: VoiceLibrary) -> SpeechRequest:
    msg = parse_json(body, cfg.max_message_bytes)
    check_unicode(msg, body)
    _check_fields(msg, SPEECH_KEYS, "speech request")
    text = msg.get("input")
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError("input must be a non-empty string")
    if len(text) > cfg.max_text_chars:
        raise TooLargeError(f"input has {len(text)} chars, limit {cfg.max_text_chars}")
    if msg.get("model") is not None and not isinstance(msg["model"], str):
        raise InvalidInputError("model must be a string")
    fmt = msg.get("response_format") or "pcm"
    if fmt not in ("pcm", "wav"):
        raise InvalidInputError(f"response_format {brief(fmt)} is not supported; use pcm or wav")
    stream = msg.get("stream_format") or "audio"
    if stream not in ("audio", "sse"):
        raise InvalidInputError(f"stream_format must be audio or sse, got {brief(stream)}")
    if stream == "sse" and fmt != "pcm":
        raise InvalidInputError("stream_format sse needs response_format pcm")
    speed = msg.get("speed")
    if speed is not None and (not _is_number(speed) or speed != 1.0):
        raise InvalidInputError(f"speed {brief(speed)} is not supported; only 1.0")
    _check_audio_format(msg)
    raw = {k: msg[k] for k in ("voice", "mode", "seed", "temperature", "top_k", "top_p", "scene") if k in msg}
    if msg.get("instructions") is not None:
        if msg.get("scene") is not None:
            raise InvalidInputError("give either instructions or scene, not both")
        raw["scene"] = msg["instructions"]
    if msg.get("reference_audio") is not None or msg.get("reference_text") is not None:
        raw["reference"] = {"audio": msg.get("reference_audio"), "transcript": msg.get("reference_text")}
        if not isinstance(raw["reference"]["audio"], str) or not isinstance(raw["reference"]["transcript"], str):
            raise InvalidInputError("reference_audio (base64) and reference_text (str) go together")
    return SpeechRequest(text, parse_options(raw, cfg, voices), fmt, stream)


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
    context_id: str


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
                self._configure(self._query_config(query))
            except HiggsStreamError as e:
                self._error(e)
        self._send({"type": "ready", **self._ready_fields()})

    # ---- inputs ----

    def receive(self, message: str | bytes, now: float) -> list[Command]:
        """One client message. Protocol errors become `error` messages; commands are returned."""
        context_id = None
        try:
            if isinstance(message, bytes):
                raise BadJsonError("binary messages are not accepted; send JSON text frames")
            msg = parse_json(message, self.cfg.max_message_bytes)
            if _valid_id(msg.get("context_id")):
                context_id = msg["context_id"]
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
        self._error(IdleTimeoutError(f"context {context_id!r} had no message and no audio for "
                                     f"{self.cfg.context_idle_s:g} s; send `end` when a context is complete"),
                    context_id)
        self._done(ctx.id, "error")
        return [Cancel(context_id)]

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
        _check_fields(msg, ("type", *CONFIG_KEYS), "config")
        self._configure({k: v for k, v in msg.items() if k != "type"})
        self._send({"type": "ready", **self._ready_fields()})
        return []

    def _on_text(self, msg: dict, now: float) -> list[Command]:
        _check_fields(msg, ("type", "context_id", "text", "flush", *OPTION_KEYS), "text")
        cid = self._context_id(msg)
        text = msg.get("text")
        if not isinstance(text, str) or not text:
            raise InvalidInputError("text must be a non-empty string")
        if len(text) > self.cfg.max_text_chars:
            raise TooLargeError(f"text has {len(text)} chars, limit {self.cfg.max_text_chars}")
        flush = msg.get("flush", False)
        if not isinstance(flush, bool):
            raise InvalidInputError("flush must be true or false")
        given = {k: msg[k] for k in OPTION_KEYS if k in msg}
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
        if flush:
            cmds.extend(Speak(cid, s) for s in ctx.text.flush())
        return cmds

    def _on_flush(self, msg: dict, now: float) -> list[Command]:
        _check_fields(msg, ("type", "context_id"), "flush")
        ctx = self._live(self._context_id(msg))
        ctx.active_at = now
        return [Speak(ctx.id, s) for s in ctx.text.flush()]

    def _on_end(self, msg: dict, now: float) -> list[Command]:
        _check_fields(msg, ("type", "context_id"), "end")
        ctx = self._live(self._context_id(msg))
        if ctx.ended:
            return []
        ctx.ended = True
        return [*(Speak(ctx.id, s) for s in ctx.text.flush()), Close(ctx.id)]

    def _on_cancel(self, msg: dict, now: float) -> list[Command]:
        _check_fields(msg, ("type", "context_id"), "cancel")
        cid = self._context_id(msg)
        if cid not in self._contexts and cid in self._recent:
            return []
        self._live(cid)
        self._done(cid, "cancelled")
        return [Cancel(cid)]

    # ---- helpers ----

    def _context_id(self, msg: dict) -> str:
        cid = msg.get("context_id")
        if not _valid_id(cid):
            raise InvalidInputError(f"context_id must be a string of 1..{MAX_CONTEXT_ID} chars")
        return cid

    def _live(self, cid: str) -> _Context:
        ctx = self._contexts.get(cid)
        if ctx is None:
            raise NotFoundError(f"no open context {brief(cid)}")
        return ctx

    def _query_config(self, query: dict[str, str]) -> dict:
        raw: dict = {}
        for key, value in query.items():
            if key == "token":
                continue
            if key not in ("audio", "voice", "sample_rate", "encoding"):
                raise InvalidInputError(f"unknown query parameter {brief(key)}")
            if key == "sample_rate":
                if not value.isdigit():
                    raise InvalidInputError(f"sample_rate must be an integer, got {brief(value)}")
                value = int(value)
            raw[key] = value
        return raw

    def _configure(self, raw: dict) -> None:
        """Validate a config change completely, then apply it (all or nothing)."""
        _check_audio_format(raw)
        framing = raw.get("audio", self.audio_framing) if "audio" in raw else self.audio_framing
        framing = "binary" if framing is None else framing
        if framing not in AUDIO_FRAMINGS:
            raise InvalidInputError(f"audio must be one of {AUDIO_FRAMINGS}, got {brief(framing)}")
        delay = raw.get("max_buffer_delay_ms", self.max_buffer_delay_ms)
        delay = self.cfg.max_buffer_delay_ms if delay is None else delay
        if not _is_int(delay) or not 0 <= delay <= 10_000:
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
