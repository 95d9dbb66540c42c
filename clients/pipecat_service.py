"""Pipecat TTS service for a higgs-stream server, over its WebSocket protocol (stream/PROTOCOL.md §1).

    tts = HiggsStreamTTSService(url="ws://127.0.0.1:8000/v1/tts/stream", voice="default")

Mapping (each Pipecat audio context is one protocol context, same id):
- `run_tts(text, ctx)` sends `text` (with the options on the context's first message), yields None;
- `flush_audio(ctx)` (end of the turn) sends `end`;
- `on_audio_context_interrupted(ctx)` (barge-in) sends `cancel`;
- the receive loop routes binary PCM to the context named by the last `audio_start`, and ends the
  context at `done` with a `TTSStoppedFrame`.

`stop_frame_timeout_s` defaults to 10 s: a context idle longer than that is closed by Pipecat and
its late audio dropped, and a cold server can take seconds before a context's first audio.
Needs the `pipecat` extra (`pip install higgs-stream[pipecat]`).
"""

from __future__ import annotations

import base64
import collections
import json
from collections.abc import AsyncGenerator
from typing import Any

import numpy as np
import soxr
from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import WebsocketTTSService
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.protocol import State

from higgs_stream.engine.errors import InvalidInputError

SERVER_SAMPLE_RATE = 24000  # protocol version 1 serves 24 kHz s16le mono only
ENDED_KEPT = 256  # contexts an error ended, remembered to ignore the server's not_found for what followed them
_OPTION_KEYS = ("mode", "seed", "temperature", "top_k", "top_p", "scene", "instructions", "reference")


class HiggsStreamTTSService(WebsocketTTSService):
    """Streams speech from a higgs-stream server; audio arrives on the receive task."""

    def __init__(
        self,
        *,
        url: str = "ws://127.0.0.1:8000/v1/tts/stream",
        token: str | None = None,
        voice: str = "default",
        sample_rate: int | None = None,
        stop_frame_timeout_s: float = 10.0,
        **kwargs: Any,
    ):
        """`url`: the server's WebSocket endpoint. `token`: sent as `Authorization: Bearer`.
        `voice`: preset name (runtime-updatable through `TTSUpdateSettingsFrame`).
        Per-context generation options go in kwargs: mode, seed, temperature, top_k, top_p,
        scene, instructions, reference (`{"audio": base64, "transcript": str}`). `sample_rate`: the rate
        of the frames pushed downstream (None: the pipeline's); the server's 24 kHz PCM is
        resampled here when they differ. Other kwargs go to `WebsocketTTSService`.
        """
        options = {k: kwargs.pop(k) for k in _OPTION_KEYS if k in kwargs}
        super().__init__(
            push_start_frame=True,
            push_text_frames=False,
            pause_frame_processing=False,
            stop_frame_timeout_s=stop_frame_timeout_s,
            sample_rate=sample_rate,
            settings=TTSSettings(model=None, voice=voice, language=None),
            **kwargs,
        )
        if not url.startswith(("ws://", "wss://")):
            raise InvalidInputError(f"url must be a ws:// or wss:// URL, got {url!r}")
        self._url = url
        self._token = token
        self._options = {k: v for k, v in options.items() if v is not None}
        self._receive_task = None
        self._open: set[str] = set()  # contexts the server has open (text sent, no done yet)
        # contexts an error ended here: the server's answers to what was already sent for them (its `end`, our
        # `cancel`: not_found) are not errors of the pipeline's
        self._ended: collections.deque[str] = collections.deque(maxlen=ENDED_KEPT)
        self._playing: str | None = None  # the context named by the last audio_start
        self._resamplers: dict[str, soxr.ResampleStream] = {}  # per context, when rates differ

    def can_generate_metrics(self) -> bool:
        return True

    # ---- connection ----

    async def start(self, frame):
        await super().start(frame)
        await self._connect()

    async def _connect(self):
        await super()._connect()
        await self._connect_websocket()
        if self._websocket and not self._receive_task:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self):
        await super()._disconnect()
        if self._receive_task:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _connect_websocket(self):
        if self._websocket and self._websocket.state is State.OPEN:
            return
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else None
        try:
            self._websocket = await self._websocket_connect(
                self._url, additional_headers=headers, compression=None, max_size=None)
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as e:  # reported; reconnects later
            self._websocket = None
            await self.push_error(error_msg=f"cannot connect to {self._url}: {e}", exception=e)
            await self._call_event_handler("on_connection_error", f"{e}")
            return
        await self._end_open_contexts("the connection was replaced")
        self._resamplers.clear()
        self._playing = None
        await self._call_event_handler("on_connected")

    async def _disconnect_websocket(self):
        try:
            await self.stop_all_metrics()
            if self._websocket:
                await self._websocket.close()
        finally:
            self._websocket = None
            await self._end_open_contexts("the connection closed")
            self._resamplers.clear()
            self._playing = None
            await self._call_event_handler("on_disconnected")

    async def _end_open_contexts(self, why: str) -> None:
        """The server's contexts went with its connection: each still open here is reported (an error naming it)
        and ended (its `TTSStoppedFrame` appended; Pipecat 1.14's reconnect does not play it: see the test)."""
        for ctx in list(self._open):
            self._open.discard(ctx)
            self._ended.append(ctx)
            if self.audio_context_available(ctx):
                await self.append_to_audio_context(ctx, TTSStoppedFrame(context_id=ctx))
                await self.remove_audio_context(ctx)
                await self.push_error(error_msg=f"{self}: context {ctx} ended: {why} before its done")

    async def _send(self, message: dict) -> None:
        if self._websocket is None:
            raise ConnectionError(f"{self}: not connected to {self._url}")
        await self._websocket.send(json.dumps(message))

    # ---- TTSService hooks ----

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        if not self._websocket or self._websocket.state is State.CLOSED:
            await self._connect()
        message: dict[str, Any] = {"type": "text", "context_id": context_id, "text": text}
        if context_id not in self._open:
            message.update(voice=self._settings.voice, **self._options)
        try:
            await self._send(message)
        except (ConnectionError, ConnectionClosed) as e:
            yield ErrorFrame(error=f"{self}: sending text failed: {e}", exception=e)
            yield TTSStoppedFrame(context_id=context_id)
            return
        self._open.add(context_id)
        await self.start_tts_usage_metrics(text)
        yield None

    async def flush_audio(self, context_id: str | None = None):
        """End of the turn: no more text for this context, so the server finishes it."""
        context_id = context_id or self.get_active_audio_context_id()
        if context_id in self._open and self._websocket is not None:
            await self._send({"type": "end", "context_id": context_id})

    async def on_audio_context_interrupted(self, context_id: str):
        """Barge-in: the server stops generating this context and drops its queued audio."""
        await self.stop_all_metrics()
        self._resamplers.pop(context_id, None)
        if context_id in self._open and self._websocket is not None:
            self._open.discard(context_id)
            await self._send({"type": "cancel", "context_id": context_id})
        await super().on_audio_context_interrupted(context_id)

    # ---- receive loop ----

    async def _receive_messages(self):
        async for message in self._websocket:
            if isinstance(message, bytes):
                await self._on_audio(self._playing, message)
            else:
                await self._on_message(json.loads(message))

    async def _on_message(self, msg: dict) -> None:
        kind, ctx = msg.get("type"), msg.get("context_id")
        if kind == "ready":
            return
        if kind == "audio_start":
            self._playing = ctx
        elif kind == "chunk":
            await self._on_audio(ctx, base64.b64decode(msg["data"]))
        elif kind == "done":
            if self._playing == ctx:
                self._playing = None
            self._open.discard(ctx)
            resampler = self._resamplers.pop(ctx, None)
            if self.audio_context_available(ctx):
                if resampler is not None and msg.get("reason") == "completed":  # the resampler's tail
                    await self._append_audio(ctx, resampler.resample_chunk(np.zeros(0, np.int16), last=True))
                await self.stop_ttfb_metrics()
                await self.append_to_audio_context(ctx, TTSStoppedFrame(context_id=ctx))
                await self.remove_audio_context(ctx)
        elif kind == "timestamps":  # not sent by protocol version 1; Cartesia-shaped when it is
            if self.audio_context_available(ctx):
                await self.add_word_timestamps(list(zip(msg["words"], msg["start"])), ctx)
        elif kind == "error":
            await self._on_error(msg)
        else:
            logger.warning(f"{self}: ignoring unknown server message type {kind!r}")

    async def _on_audio(self, ctx: str | None, pcm: bytes) -> None:
        if ctx is None or not self.audio_context_available(ctx):
            return  # audio of a context that was interrupted here: dropped
        await self.stop_ttfb_metrics()
        samples = np.frombuffer(pcm, dtype="<i2")  # [n]
        if self.sample_rate != SERVER_SAMPLE_RATE:
            # One stream resampler per context, never reset on gaps (the server's chunks can be
            # more than Pipecat's 0.2 s idle-reset apart), flushed at the context's done.
            resampler = self._resamplers.get(ctx)
            if resampler is None:
                resampler = self._resamplers[ctx] = soxr.ResampleStream(
                    SERVER_SAMPLE_RATE, self.sample_rate, 1, dtype="int16", quality="VHQ")
            samples = resampler.resample_chunk(samples)
        await self._append_audio(ctx, samples)

    async def _append_audio(self, ctx: str, samples: np.ndarray) -> None:
        if samples.size:
            await self.append_to_audio_context(ctx, TTSAudioRawFrame(
                audio=samples.astype("<i2").tobytes(), sample_rate=self.sample_rate, num_channels=1, context_id=ctx))

    async def _on_error(self, msg: dict) -> None:
        ctx = msg.get("context_id")
        text = f"{self}: server error [{msg.get('code')}]: {msg.get('message')}"
        if ctx is not None and (ctx in self._ended or ctx not in self._open and not self.audio_context_available(ctx)):
            logger.debug(f"{text} (context {ctx} already ended here)")
            return
        await self.push_error(error_msg=text)
        if ctx is None:
            return
        # Any error on a context ends it here; cancel it so the server cannot hold later
        # contexts behind it (a cancel or an `end` for a context the server never opened is answered with
        # not_found, ignored above through `_ended`).
        self._ended.append(ctx)
        if ctx in self._open:
            self._open.discard(ctx)
            await self._send({"type": "cancel", "context_id": ctx})
        if self._playing == ctx:
            self._playing = None
        self._resamplers.pop(ctx, None)
        if self.audio_context_available(ctx):
            await self.stop_all_metrics()
            await self.append_to_audio_context(ctx, TTSStoppedFrame(context_id=ctx))
            await self.remove_audio_context(ctx)
