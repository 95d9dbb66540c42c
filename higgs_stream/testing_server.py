"""A live server on loopback for the tests, on either transport: the aiohttp server or the ASGI app
(uvicorn), one protocol implementation behind both (stream/driver.py, stream/routes.py); and `Peer`,
one WebSocket connection to it as the tests read it."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest
from higgs_stream.engine.codec import load_codec
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.request import GenerationRequest, SamplingParams
from higgs_stream.engine.synth import synthesize
from higgs_stream.stream.adapter import to_s16le
from higgs_stream.stream.asgi import serve_asgi
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.stream.server import bound_port, serve
from higgs_stream.stream.server_state import ServerState
from higgs_stream.stream.voices import VoiceLibrary

TRANSPORTS = ("aiohttp", "asgi")
LONG_TEXT, LONG_SEED = "A long sentence that keeps going.", 4  # 229 frames on the tiny checkpoint
WS_ERROR_CODES = frozenset({"bad_json", "unknown_type", "invalid_input", "too_large", "not_found", "bad_audio", "busy",
                            "unauthorized", "slow_client", "idle_timeout", "shutting_down",
                            "internal"})  # PROTOCOL.md §3, WebSocket side


async def wait_until(pred: Callable[[], Any], timeout: float = 10.0) -> None:
    """Wait for a condition the server reaches on its own (pages freed, a gauge)."""
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)


async def pages_freed(engine, timeout: float = 5.0) -> None:
    """Wait until `engine` runs no stream and holds no KV page (cancels apply at its next step)."""
    await wait_until(lambda: not (engine.num_active or engine.cache.allocator.num_used), timeout)


async def speak(ws: Any, cid: str, text: str, seed: int, **opts: Any) -> None:
    """One whole context over a WebSocket: its text (with `opts`), then `end`."""
    await ws.send(json.dumps({"type": "text", "context_id": cid, "text": text, "seed": seed, **opts}))
    await ws.send(json.dumps({"type": "end", "context_id": cid}))


async def serve_on(transport: str, state: ServerState):
    """(runner with `cleanup()`, port) of the app on `transport`, on a free loopback port."""
    if transport == "aiohttp":
        runner = await serve(state, "127.0.0.1", 0)
        return runner, bound_port(runner)
    server = await serve_asgi(state, "127.0.0.1", 0)
    return server, server.port


def tiny_codec_engine(kv_pages: int):
    """Module-scoped `codec` and `engine` fixtures on the tiny checkpoint (`tiny_ckpt`): bind them in a test
    module as `codec, engine = tiny_codec_engine(kv_pages=...)`; the name `codec` overrides tests/stream's
    session-wide reference codec in that module."""

    @pytest.fixture(scope="module")
    def codec(tiny_ckpt):
        return load_codec(tiny_ckpt / "audio_tokenizer")

    @pytest.fixture(scope="module")
    def engine(tiny_ckpt):
        return Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(kv_pages=kv_pages))

    return codec, engine


def tiny_reference(max_frames: int):
    """A module-scoped `reference` fixture: `synth_reference` on the tiny checkpoint and the module's codec."""

    @pytest.fixture(scope="module")
    def reference(tiny_ckpt, codec):
        """s16le of engine.synth.synthesize for (text, seed) on a separate engine, cached."""
        return synth_reference(tiny_ckpt, codec, max_frames)

    return reference


def synth_reference(ckpt: Path, codec, max_frames: int) -> Callable[..., bytes]:
    """pcm(text, seed, max_frames=max_frames) -> s16le of the offline synthesis on an engine of its
    own (cached)."""
    eng = Engine.from_pretrained(str(ckpt), config=EngineConfig(kv_pages=512))
    cache: dict[tuple, bytes] = {}

    def pcm(text: str, seed: int, max_frames: int = max_frames) -> bytes:
        if (text, seed, max_frames) not in cache:
            req = GenerationRequest(text, sampling=SamplingParams(seed=seed), max_frames=max_frames)
            cache[text, seed, max_frames] = to_s16le(synthesize(eng, codec, req)[0])
        return cache[text, seed, max_frames]

    return pcm


class ServerStarter:
    """`await start(**ServerConfig fields)` -> ("127.0.0.1:PORT", state): a server over `engine` and
    `codec` on `transport` (load admission off unless asked: it has its own tests); `close()` stops all."""

    def __init__(self, transport: str, engine, codec, max_frames: int) -> None:
        self.transport, self.engine, self.codec, self.max_frames = transport, engine, codec, max_frames
        self._runners: list = []

    async def __call__(self, **cfg) -> tuple[str, ServerState]:
        cfg.setdefault("max_frames", self.max_frames)
        config = ServerConfig(port=0, **{"admit_step_ratio": None, **cfg})
        metrics = Metrics()
        state = ServerState(config, Pipeline(self.engine, self.codec, config, metrics),
                            VoiceLibrary.from_config(config, speakers=self.engine.policy.speakers), metrics)
        runner, port = await serve_on(self.transport, state)
        self._runners.append(runner)
        return f"127.0.0.1:{port}", state

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners = []


class Peer:
    """One WebSocket connection read as the protocol says (stream/PROTOCOL.md): every JSON event in
    order; PCM per context, from binary frames (they belong to the context of the last audio_start,
    until its done) or base64 `chunk` events; each context's `done` (`done`: the last, `dones`: every
    one, in order); the `error` events; the largest gap between two audio frames of a context.
    With `error_codes`, every error must carry one of those codes and a message."""

    def __init__(self, ws: Any, error_codes: Collection[str] | None = None) -> None:
        self.ws, self.error_codes = ws, error_codes
        self.events: list[dict] = []
        self.pcm: dict[str, bytearray] = {}
        self.done: dict[str, dict] = {}
        self.dones: dict[str, list[dict]] = {}
        self.errors: list[dict] = []
        self.max_gap: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self.playing: str | None = None

    async def until(self, pred: Callable[[], Any], timeout: float = 60.0) -> None:
        """Read messages until `pred()` holds (TimeoutError after `timeout` s)."""
        async with asyncio.timeout(timeout):
            while not pred():
                self.handle(await self.ws.recv())

    def handle(self, msg: str | bytes) -> None:
        now = time.monotonic()
        if isinstance(msg, bytes):
            assert self.playing is not None, "binary frame outside an audio_start/done bracket"
            self._frame(self.playing, msg, now)
            return
        ev = json.loads(msg)
        self.events.append(ev)
        kind, cid = ev["type"], ev.get("context_id")
        if kind == "audio_start":
            assert self.playing is None, f"audio_start {cid} while {self.playing} plays"
            self.playing = cid
            self.pcm[cid] = bytearray()
        elif kind == "chunk":
            assert cid == self.playing, f"chunk of {cid} while {self.playing} plays"
            self._frame(cid, base64.b64decode(ev["data"]), now)
        elif kind == "done":
            self.done[cid] = ev
            self.dones.setdefault(cid, []).append(ev)
            if cid == self.playing:
                self.playing = None
        elif kind == "error":
            if self.error_codes is not None:
                assert ev["code"] in self.error_codes and ev["message"], ev
            self.errors.append(ev)

    def _frame(self, cid: str, data: bytes, now: float) -> None:
        assert len(data) % 2 == 0 and data, f"{len(data)} bytes of s16 PCM"
        if cid in self._last:
            self.max_gap[cid] = max(self.max_gap.get(cid, 0.0), now - self._last[cid])
        self._last[cid] = now
        self.pcm[cid] += data

    def ended(self, cid: str) -> bool:
        return cid in self.done

    async def say(self, cid: str, text: str, seed: int, end: bool = True, **opts: Any) -> None:
        """A `text` message for context `cid` (extra fields `opts`), then its `end` unless `end=False`."""
        await self.ws.send(json.dumps({"type": "text", "context_id": cid, "text": text, "seed": seed, **opts}))
        if end:
            await self.ws.send(json.dumps({"type": "end", "context_id": cid}))


def protocol_peer(ws: Any) -> Peer:
    """A `Peer` whose every error must carry a code of PROTOCOL.md §3 (WebSocket side) and a message."""
    return Peer(ws, WS_ERROR_CODES)
