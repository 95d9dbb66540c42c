"""`POST /v1/audio/speech`, OpenAI-compatible and streamed (stream/PROTOCOL.md §2): the body is
parsed like one WebSocket context that gets the whole input and then `end`; its audio goes out in
the requested `response_format` (mp3 by default, as OpenAI) and `sample_rate` (24 kHz by default),
resampled and encoded chunk by chunk as it arrives (stream/encoders.py), as the body or base64 in
server-sent events. aiohttp cancels the handler when the client leaves
(`handler_cancellation=True`), and `finally` cancels the stream, so its engine pages are freed
within one step.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging

from aiohttp import web
from higgs_stream.engine.errors import HiggsStreamError
from higgs_stream.stream.config import SAMPLE_RATE
from higgs_stream.stream.encoders import Encoder, content_type, make_encoder
from higgs_stream.stream.guards import check_request, error_response, read_body
from higgs_stream.stream.messages import SpeechRequest, parse_speech
from higgs_stream.stream.handle import Audio, End, StreamHandle
from higgs_stream.stream.server_state import STATE
from higgs_stream.stream.text import TextBuffer

log = logging.getLogger(__name__)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def speech(request: web.Request) -> web.StreamResponse:
    """POST /v1/audio/speech (PROTOCOL.md §2)."""
    state = request.app[STATE]
    cfg = state.config
    try:
        check_request(request, cfg, json_body=True)
        req = parse_speech(await read_body(request, cfg), cfg, state.voices)
        handle = state.pipeline.open(req.options, transport="http")
    except HiggsStreamError as e:
        return error_response(e, state.metrics)
    try:
        text = TextBuffer(cfg.max_segment_chars)
        for segment in text.append(req.input, 0.0) + text.flush():
            handle.say(segment)
        handle.close()
        events = await handle.next(cfg.max_send_bytes, first_alone=True)
        first = events[0]
        if isinstance(first, End) and first.error is not None:
            return error_response(first.error, state.metrics)  # failed before any audio: a plain error
        sse = req.stream_format == "sse"
        resp = web.StreamResponse(status=200)
        body_type = content_type(req.response_format, req.sample_rate)
        resp.headers["Content-Type"] = "text/event-stream" if sse else body_type
        resp.headers["Cache-Control"] = "no-cache"
        encoder = make_encoder(req.response_format, req.sample_rate)  # before the headers: a failure here is a JSON 500
        try:
            await _speech_body(request, resp, handle, req, events, encoder)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:  # headers are out: no JSON error possible; the client sees a truncated body
            log.exception("speech stream failed after its headers were sent")
            state.metrics.errors.inc(code="internal")
            if request.transport is not None:
                request.transport.close()
        return resp
    finally:
        handle.cancel()  # no-op when it completed; frees the engine stream when the client left


async def _speech_body(request: web.Request, resp: web.StreamResponse, handle: StreamHandle, req: SpeechRequest,
                       events: list, encoder: Encoder) -> None:
    """Send the headers, then encode and write the audio until the stream ends."""
    try:
        await resp.prepare(request)
        await _encode_and_send(request, resp, handle, req, events, encoder)
    finally:
        encoder.close()  # no-op after flush; frees the FFmpeg contexts when the stream failed


async def _encode_and_send(request: web.Request, resp: web.StreamResponse, handle: StreamHandle,
                           req: SpeechRequest, events: list, encoder: Encoder) -> None:
    state = request.app[STATE]
    cfg = state.config
    sse = req.stream_format == "sse"

    async def send(data: bytes) -> None:
        if data:
            await resp.write(_sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                             if sse else data)

    samples = 0
    while True:
        for ev in events:
            if isinstance(ev, Audio):
                samples += len(ev.pcm) // 2
                await send(encoder.feed(ev.pcm))
                continue
            if ev.reason == "completed":
                await send(encoder.flush())
                if sse:
                    tokens = len(state.pipeline.engine.tokenizer.encode(req.input))
                    frames = samples // (SAMPLE_RATE // 25)
                    await resp.write(_sse({"type": "speech.audio.done", "usage": {
                        "input_tokens": tokens, "output_tokens": frames, "total_tokens": tokens + frames}}))
                await resp.write_eof()
                return
            error = ev.error or HiggsStreamError(f"stream ended: {ev.reason}")
            state.metrics.errors.inc(code=error.code)
            log.warning("speech stream failed after its headers were sent: %s: %s", error.code, error)
            if sse:
                await resp.write(_sse({"type": "error", "error": {"code": error.code, "message": str(error)}}))
                await resp.write_eof()
                return
            request.transport.close()  # no final chunk: the client sees a truncated body
            return
        events = await handle.next(cfg.max_send_bytes)
