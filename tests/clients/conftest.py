"""A live higgs-stream server (aiohttp app, real engine and codec) on the tiny random checkpoint,
listening on 127.0.0.1 with an ephemeral port, for the client-side tests."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from higgs_stream.engine.request import GenerationRequest, SamplingParams
from higgs_stream.engine.synth import synthesize
from higgs_stream.stream import serve_command, server
from higgs_stream.stream.adapter import to_s16le


@dataclass
class LiveServer:
    state: server.ServerState
    port: int
    token: str | None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/tts/stream"


def server_args(model: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    # admission by load off: a loaded 2-core CI machine may run the tiny model below 2x real time
    return parser.parse_args(["--model", str(model), "--device", "cpu", "--admit-step-ratio", "0", *extra])


async def start_server(model: Path, *extra: str) -> tuple[LiveServer, object]:
    args = server_args(model, *extra)
    state = serve_command.build_state(args)
    runner = await server.serve(state, "127.0.0.1", 0)
    return LiveServer(state, server.bound_port(runner), args.token), runner


def _reference_pcm(state: server.ServerState, text: str, seed: int) -> bytes:
    """`engine.synth.synthesize` for what the server generates for a one-segment context with
    default options and `seed` (PROTOCOL.md §2: equal within 1 LSB in exact mode), as s16le bytes.
    Call only while the server's engine thread is stopped: the engine is not thread-safe."""
    cfg = state.config
    request = GenerationRequest(text=text, sampling=SamplingParams(seed=seed), max_frames=cfg.max_frames)
    wav, _ = synthesize(state.pipeline.engine, state.pipeline.codec, request)  # [F * 960]
    return to_s16le(wav)


def s16(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768


@pytest.fixture
async def server_factory(tiny_ckpt):
    """`await server_factory(*cli_flags) -> LiveServer` on the tiny checkpoint; stopped at teardown."""
    runners = []

    async def make(*extra: str) -> LiveServer:
        live, runner = await start_server(tiny_ckpt, *extra)
        runners.append(runner)
        return live

    yield make
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def live_server(server_factory) -> LiveServer:
    return await server_factory("--max-frames", "150")


@pytest.fixture
def reference_pcm():
    """`reference_pcm(state, text, seed) -> bytes`: the offline synthesis the stream must equal."""
    return _reference_pcm
