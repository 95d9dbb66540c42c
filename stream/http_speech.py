"""`POST /v1/audio/speech`, OpenAI-compatible and streamed (stream/PROTOCOL.md §2): the body is
parsed like one WebSocket context that gets the whole input and then `end`; its audio goes out in
the requested `response_format` (mp3 by default, as OpenAI) and `sample_rate` (24 kHz by default),
resampled and encoded chunk by chunk as it arrives (stream/encoders.py), as the body or base64 in
server-sent events.

Independent of the web framework: `speech` answers a `Request` (stream/routes.py) with a JSON
error `Reply` or a `StreamReply` whose chunks the transport writes. The transport stops iterating
when the client leaves and closes the reply, whose `on_close` cancels the stream, so its engine
pages are freed within one step.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator

from higgs_stream.engine.errors import HiggsStreamError
from higgs_stream.stream.encoders import Encoder, content_type, make_encoder
from higgs_stream.stream.guards import check_request, read_body
from higgs_stream.stream.handle import Audio, End, StreamHandle
from higgs_stream.stream.messages import SpeechRequest, parse_speech
from higgs_stream.stream.routes import Reply, Request, StreamAborted, StreamReply, failure_reply
from higgs_stream.stream.server_state import ServerState
from higgs_stream.stream.text import TextBuffer

log = logging.getLogger(__name__)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def speech(state: ServerState, request: Request) -> Reply | StreamReply:
    """POST /v1/audio/speech (PROTOCOL.md §2). Headers go out once the first audio (or the end)
    is there: an error found before that is a plain JSON error with its status."""
    cfg = state.config
    try:
        check_request(request, cfg, json_body=True)
        req = parse_speech(await read_body(request, cfg), cfg, state.voices)
        handle = state.pipeline.open(req.options, transport="http")
    except HiggsStreamError as e:
        return failure_reply(e, state)
    try:
        text = TextBuffer(cfg.max_segment_chars)
        handle.say(*text.append(req.input, 0.0), *text.flush())  # together: checked before any audio (handle._pump)
        handle.close()
        events = await handle.next(cfg.max_send_bytes, first_alone=True)
        first = events[0]
        if isinstance(first, End) and first.error is not None:
            handle.cancel()
            return failure_reply(first.error, state)  # failed before any audio: a plain error
        encoder = make_encoder(req.response_format, req.sample_rate)  # before the headers: a failure is a JSON 500
    except BaseException as e:  # frees the engine stream when the client left (the handler cancelled) or it failed
        handle.cancel("disconnected" if isinstance(e, asyncio.CancelledError) else "cancelled")
        raise
    body_type = "text/event-stream" if req.stream_format == "sse" else content_type(req.response_format, req.sample_rate)

    def close() -> None:
        encoder.close()  # no-op after flush; frees the FFmpeg contexts when the stream failed
        handle.cancel("disconnected")  # no-op when it completed; frees the engine stream when the client left

    return StreamReply(200, body_type, _body(state, handle, req, events, encoder), {"Cache-Control": "no-cache"},
                       on_close=close)


async def _body(state: ServerState, handle: StreamHandle, req: SpeechRequest, events: list,
                encoder: Encoder) -> AsyncIterator[bytes]:
    """The encoded audio until the stream ends; StreamAborted after a failure (the headers are
    out: no JSON error is possible, the client sees a truncated body)."""
    try:
        async for piece in _encode(state, handle, req, events, encoder):
            yield piece
    except (ConnectionError, asyncio.CancelledError, GeneratorExit, StreamAborted):
        raise
    except Exception:
        log.exception("speech stream failed after its headers were sent")
        state.metrics.errors.inc(code="internal")
        raise StreamAborted("speech stream failed") from None


async def _encode(state: ServerState, handle: StreamHandle, req: SpeechRequest, events: list,
                  encoder: Encoder) -> AsyncIterator[bytes]:
    cfg = state.config
    sse = req.stream_format == "sse"

    def delta(data: bytes) -> bytes:
        return _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if sse else data

    samples = 0
    while True:
        for ev in events:
            if isinstance(ev, Audio):
                samples += len(ev.pcm) // 2
                if data := encoder.feed(ev.pcm):
                    yield delta(data)
                continue
            if ev.reason == "completed":
                if data := encoder.flush():
                    yield delta(data)
                if sse:
                    tokens = len(state.pipeline.engine.tokenizer.encode(req.input))
                    frames = samples // state.pipeline.geometry.hop  # codec frames
                    yield _sse({"type": "speech.audio.done", "usage": {
                        "input_tokens": tokens, "output_tokens": frames, "total_tokens": tokens + frames}})
                return
            error = ev.error or HiggsStreamError(f"stream ended: {ev.reason}")
            state.metrics.errors.inc(code=error.code)
            log.warning("speech stream failed after its headers were sent: %s: %s", error.code, error)
            if sse:
                yield _sse({"type": "error", "error": {"code": error.code, "message": str(error)}})
                return
            raise StreamAborted(f"stream ended: {ev.reason}")  # no final chunk: the client sees a truncated body
        events = await handle.next(cfg.max_send_bytes)
