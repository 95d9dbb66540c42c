"""The live server the reliability and soak tests run against: the tiny checkpoint's engine and codec
(this folder's `codec` fixture is the tiny checkpoint's, not tests/stream's), offline reference audio,
and a server started per transport that must leave no stream, KV page or logged traceback behind."""

from __future__ import annotations

import logging

import pytest
from higgs_stream.testing_server import TRANSPORTS, ServerStarter, tiny_codec_engine, tiny_reference

MAX_FRAMES = 30


codec, engine = tiny_codec_engine(kv_pages=1024)
reference = tiny_reference(MAX_FRAMES)


@pytest.fixture(params=TRANSPORTS)
async def start_server(request, engine, codec, caplog):
    """start(**ServerConfig fields) -> ("127.0.0.1:PORT", state), on the aiohttp server or the ASGI
    app (uvicorn). On teardown: no stream, no KV page and no logged traceback is left behind."""
    start = ServerStarter(request.param, engine, codec, MAX_FRAMES)
    yield start
    await start.close()
    assert engine.num_active == 0 and engine.cache.allocator.num_used == 0, "KV pages leaked"
    tracebacks = [r for r in caplog.get_records("call") if r.exc_info and r.levelno >= logging.ERROR]
    assert not tracebacks, f"server logged a traceback: {tracebacks[0].getMessage()}"
