"""What a client may send (stream/PROTOCOL.md §1.1 and §2), parsed and validated: JSON with its
depth and Unicode checks, the per-context options, the message schemas of the WebSocket protocol
and the HTTP speech body. Pure functions: no session state, no I/O. Everything a client gets wrong
ends here as a typed error (stream/errors.py); `Session` (stream/session.py) runs the state machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.stream.config import MODES, SAMPLE_RATE, ServerConfig
from higgs_stream.stream.encoders import FORMATS, rates_for
from higgs_stream.stream.errors import BadJsonError, TooLargeError, brief
from higgs_stream.stream.voices import DEFAULT, Voice, VoiceLibrary

OPTION_KEYS = ("voice", "reference", "mode", "seed", "temperature", "top_k", "top_p", "scene", "instructions")
CONFIG_KEYS = (*OPTION_KEYS, "audio", "sample_rate", "encoding", "max_buffer_delay_ms")
QUERY_KEYS = ("audio", "voice", "sample_rate", "encoding")  # besides `token`
AUDIO_FRAMINGS = ("binary", "base64")
MAX_CONTEXT_ID = 128
DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 0.7, 0.95  # Boson's serve engine defaults (engine/request.py)
MAX_JSON_DEPTH = 16  # nesting of a client message (the protocol's own messages need 3)


# ---- JSON ----

def check_size(message: str | bytes, limit: int) -> None:
    """TooLargeError for a client message (text as UTF-8, or binary) of more than `limit` bytes."""
    size = len(message) if isinstance(message, bytes) else len(message.encode("utf-8"))
    if size > limit:
        raise TooLargeError(f"message of {size} bytes over the limit of {limit}")


def parse_json(message: str | bytes, limit: int) -> dict:
    """A JSON object from a client message of at most `limit` bytes, nested at most MAX_JSON_DEPTH
    deep. Whatever a client sends ends here as a typed error: no RecursionError, no ValueError
    (a 5000-digit number), no UnicodeError (bytes that are not UTF-8, a str with lone surrogates)."""
    try:
        check_size(message, limit)
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


# ---- field checks ----

def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def valid_id(cid: Any) -> bool:
    return isinstance(cid, str) and 1 <= len(cid) <= MAX_CONTEXT_ID


def check_fields(msg: dict, allowed: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(msg) - set(allowed))
    if unknown:  # named briefly, at most 8 of them: a probe's 4 MB key came back as a 4 MB error
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise InvalidInputError(f"unknown field(s) in {what}: {', '.join(brief(k) for k in unknown[:8])}{more}")


def check_audio_format(raw: dict) -> None:
    rate = raw.get("sample_rate")
    if rate is not None and not (is_int(rate) and rate == SAMPLE_RATE):  # 24000.0 and true are no rates either
        raise InvalidInputError(f"sample_rate {brief(rate)} is not supported; only {SAMPLE_RATE}")
    encoding = raw.get("encoding")
    if encoding is not None and encoding != "pcm_s16le":
        raise InvalidInputError(f"encoding {brief(encoding)} is not supported; only pcm_s16le")


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
    instructions: str | None = None  # a voice/style description (the model decides what it takes)


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
    if seed is not None and (not is_int(seed) or not 0 <= seed < 2**63):
        raise InvalidInputError(f"seed must be an int in [0, 2**63) or null, got {brief(seed)}")
    temperature = value("temperature", DEFAULT_TEMPERATURE)
    if not is_number(temperature) or not 0.0 <= temperature <= 2.0:
        raise InvalidInputError(f"temperature must be a number in [0, 2], got {brief(temperature)}")
    top_k = raw.get("top_k")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise InvalidInputError(f"top_k must be an int >= 1 or null, got {brief(top_k)}")
    top_p = value("top_p", DEFAULT_TOP_P)
    if not is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidInputError(f"top_p must be a number in (0, 1], got {brief(top_p)}")
    scene = raw.get("scene")
    if scene is not None:
        if not isinstance(scene, str):
            raise InvalidInputError(f"scene must be a string or null, got {type(scene).__name__}")
        if len(scene) > cfg.max_scene_chars:
            raise TooLargeError(f"scene has {len(scene)} chars, limit {cfg.max_scene_chars}")
    instructions = raw.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidInputError(f"instructions must be a string or null, got {type(instructions).__name__}")
        if len(instructions) > cfg.max_instructions_chars:
            raise TooLargeError(f"instructions have {len(instructions)} chars, limit {cfg.max_instructions_chars}")
        if scene is not None:
            raise InvalidInputError("give either instructions or scene, not both")
    return ContextOptions(voice=voice, mode=mode, seed=seed, temperature=float(temperature),
                          top_k=top_k, top_p=float(top_p), scene=scene, instructions=instructions)


# ---- WebSocket messages (§1.1): their schema; what they do is the session's ----

@dataclass(frozen=True)
class TextMessage:
    context_id: str
    text: str
    flush: bool
    given: dict  # the option fields it sets (only those present)


def parse_context_id(msg: dict) -> str:
    cid = msg.get("context_id")
    if not valid_id(cid):
        raise InvalidInputError(f"context_id must be a string of 1..{MAX_CONTEXT_ID} chars")
    return cid


def parse_config(msg: dict) -> dict:
    """A `config` message's fields (without `type`); their values are checked when applied."""
    check_fields(msg, ("type", *CONFIG_KEYS), "config")
    return {k: v for k, v in msg.items() if k != "type"}


def parse_text(msg: dict, cfg: ServerConfig) -> TextMessage:
    check_fields(msg, ("type", "context_id", "text", "flush", *OPTION_KEYS), "text")
    cid = parse_context_id(msg)
    text = msg.get("text")
    if not isinstance(text, str) or not text:
        raise InvalidInputError("text must be a non-empty string")
    if len(text) > cfg.max_text_chars:
        raise TooLargeError(f"text has {len(text)} chars, limit {cfg.max_text_chars}")
    flush = msg.get("flush", False)
    if not isinstance(flush, bool):
        raise InvalidInputError("flush must be true or false")
    return TextMessage(cid, text, flush, {k: msg[k] for k in OPTION_KEYS if k in msg})


def parse_context_message(msg: dict) -> str:
    """The context id of a `flush`, `end` or `cancel` message (they carry nothing else)."""
    check_fields(msg, ("type", "context_id"), msg["type"])
    return parse_context_id(msg)


def parse_query(query: dict[str, str]) -> dict:
    """The WebSocket URL's query parameters as `config` fields (`token` is the transport's)."""
    raw: dict = {}
    for key, value in query.items():
        if key == "token":
            continue
        if key not in QUERY_KEYS:
            raise InvalidInputError(f"unknown query parameter {brief(key)}")
        if key == "sample_rate":
            # ASCII digits only: str.isdigit() also takes '²', which int() refuses; the range is checked when applied
            if not (value.isascii() and value.isdigit() and len(value) <= 9):
                raise InvalidInputError(f"sample_rate must be an integer, got {brief(value)}")
            value = int(value)
        raw[key] = value
    return raw


# ---- HTTP: POST /v1/audio/speech (§2) ----

SPEECH_KEYS = ("input", "model", "voice", "response_format", "stream_format", "speed", "instructions",
               "reference_audio", "reference_text", "seed", "temperature", "top_k", "top_p", "mode",
               "scene", "sample_rate")


@dataclass(frozen=True)
class SpeechRequest:
    input: str
    options: ContextOptions
    response_format: str = "mp3"  # stream/encoders.py FORMATS
    stream_format: str = "audio"  # audio | sse
    sample_rate: int = SAMPLE_RATE  # of the response (stream/encoders.py RATES); resampled when not 24000


def parse_speech(body: bytes | str, cfg: ServerConfig, voices: VoiceLibrary) -> SpeechRequest:
    msg = parse_json(body, cfg.max_message_bytes)
    check_unicode(msg, body)
    check_fields(msg, SPEECH_KEYS, "speech request")
    text = msg.get("input")
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError("input must be a non-empty string")
    if len(text) > cfg.max_text_chars:
        raise TooLargeError(f"input has {len(text)} chars, limit {cfg.max_text_chars}")
    if msg.get("model") is not None and not isinstance(msg["model"], str):
        raise InvalidInputError("model must be a string")
    fmt = "mp3" if msg.get("response_format") is None else msg["response_format"]  # OpenAI's default (not `or`:
    # false, 0, "" and [] were taken for it, found by a probe)
    if fmt not in FORMATS:
        raise InvalidInputError(f"response_format {brief(fmt)} is not supported; use one of {', '.join(FORMATS)}")
    stream = "audio" if msg.get("stream_format") is None else msg["stream_format"]
    if stream not in ("audio", "sse"):
        raise InvalidInputError(f"stream_format must be audio or sse, got {brief(stream)}")
    speed = msg.get("speed")
    if speed is not None and (not is_number(speed) or not 0.25 <= speed <= 4.0):
        raise InvalidInputError(f"speed must be a number from 0.25 to 4.0, got {brief(speed)}")
    if speed is not None and speed != 1.0:
        raise InvalidInputError(f"speed {brief(speed)} is not supported: this server speaks at speed 1.0 only")
    rate = SAMPLE_RATE if msg.get("sample_rate") is None else msg["sample_rate"]
    if not is_int(rate) or rate not in rates_for(fmt):
        raise InvalidInputError(f"sample_rate {brief(rate)} is not offered for {fmt}; use one of "
                                f"{', '.join(map(str, rates_for(fmt)))}")
    raw = {k: msg[k] for k in ("voice", "mode", "seed", "temperature", "top_k", "top_p", "scene", "instructions")
           if k in msg}
    if msg.get("reference_audio") is not None or msg.get("reference_text") is not None:
        raw["reference"] = {"audio": msg.get("reference_audio"), "transcript": msg.get("reference_text")}
        if not isinstance(raw["reference"]["audio"], str) or not isinstance(raw["reference"]["transcript"], str):
            raise InvalidInputError("reference_audio (base64) and reference_text (str) go together")
    return SpeechRequest(text, parse_options(raw, cfg, voices), fmt, stream, rate)
