"""A live server on loopback for the tests, on either transport: the aiohttp server or the ASGI app
(uvicorn), one protocol implementation behind both (stream/driver.py, stream/routes.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

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


async def serve_on(transport: str, state: ServerState):
    """(runner with `cleanup()`, port) of the app on `transport`, on a free loopback port."""
    if transport == "aiohttp":
        runner = await serve(state, "127.0.0.1", 0)
        return runner, bound_port(runner)
    server = await serve_asgi(state, "127.0.0.1", 0)
    return server, server.port


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
