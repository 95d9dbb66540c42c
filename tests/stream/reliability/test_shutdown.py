"""Shutdown (stream/driver.py: drain): on SIGTERM / SIGINT, or at the ASGI lifespan's end, new streams are refused
with `shutting_down` while the open ones run to their `done`; what is still open when the drain runs out ends with
`error{shutting_down}` + `done` (HTTP: its format's error), then the sockets close with 1001. Every accepted context
ends with `done` or `error`, at shutdown too."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from higgs_stream.loadgen.spawn import spawned_server
from higgs_stream.stream.asgi import make_asgi_app
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.driver import drain
from higgs_stream.stream.errors import ShuttingDownError
from higgs_stream.stream.messages import ContextOptions
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.stream.server_state import ServerState
from higgs_stream.stream.voices import VoiceLibrary
from higgs_stream.testing import collect, default_voice
from higgs_stream.testing_server import LONG_SEED, LONG_TEXT, Peer, pages_freed, protocol_peer, speak
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed


async def test_shutdown_lets_open_streams_finish_and_refuses_new_ones(start_server):
    """A drain (aiohttp on SIGTERM / SIGINT, the ASGI lifespan's end): new contexts and HTTP requests get
    `shutting_down` (503 + Retry-After), /healthz says "draining", the open stream runs to its end with all its audio,
    then the socket closes with 1001 (going away)."""
    host, state = await start_server(drain_s=60.0)
    async with connect(f"ws://{host}/v1/tts/stream") as ws, aiohttp.ClientSession() as http:
        lis = protocol_peer(ws)
        await speak(ws, "a", LONG_TEXT, LONG_SEED)
        await lis.until(lambda: lis.pcm.get("a"))  # it is generating
        draining = asyncio.create_task(drain(state, state.config.drain_s))
        while not state.pipeline.draining:
            await asyncio.sleep(0)
        await ws.send(json.dumps({"type": "text", "context_id": "late", "text": "Hi."}))
        async with http.post(f"http://{host}/v1/audio/speech", json={"input": "Hi."}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "shutting_down"
        async with http.get(f"http://{host}/healthz") as r:
            assert r.status == 503 and (await r.json())["status"] == "draining"
        await lis.until(lambda: "a" in lis.done)
        assert lis.done["a"]["reason"] == "completed" and lis.done["a"]["samples"] * 2 == len(lis.pcm["a"]) > 0
        assert [(e["code"], e["context_id"]) for e in lis.errors] == [("shutting_down", "late")]
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                lis.handle(await ws.recv())
        assert closed.value.rcvd.code == 1001
        await draining
        assert state.metrics.errors.value(code="shutting_down") == 2


async def test_a_stream_still_open_when_the_drain_runs_out_ends_with_shutting_down(start_server):
    """Every accepted context ends with `done` or `error`, at shutdown too: one left open (no `end`) past the drain
    gets error{shutting_down} + done{reason: error} before the socket closes with 1001."""
    host, state = await start_server(drain_s=0.2)
    async with connect(f"ws://{host}/v1/tts/stream") as ws:
        lis = protocol_peer(ws)
        await ws.send(json.dumps({"type": "text", "context_id": "open", "text": "Hello there.", "seed": 3}))
        await lis.until(lambda: lis.pcm.get("open"))
        draining = asyncio.create_task(drain(state, state.config.drain_s))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                lis.handle(await ws.recv())
        assert closed.value.rcvd.code == 1001
        await draining
    assert [(e["code"], e["context_id"]) for e in lis.errors] == [("shutting_down", "open")]
    assert lis.done["open"]["reason"] == "error"
    await pages_freed(state.pipeline.engine)


async def test_an_http_stream_still_open_when_the_drain_runs_out_ends_with_its_error_event(start_server):
    """HTTP streams drain too: a `stream_format: sse` request still generating when the drain runs out (here at
    once) ends with the SSE error event `shutting_down` (its audio so far delivered), never a bare cut."""
    host, state = await start_server(drain_s=0.0, max_frames=300)  # 0: end what is open at once
    async with aiohttp.ClientSession() as http:
        body = {"input": LONG_TEXT, "seed": LONG_SEED, "stream_format": "sse", "response_format": "pcm"}
        async with http.post(f"http://{host}/v1/audio/speech", json=body) as r:
            assert r.status == 200
            events = []
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:  # audio flows: shut down
                        draining = asyncio.create_task(drain(state, state.config.drain_s))
    await draining
    kinds = [e["type"] for e in events]
    assert kinds[0] == "speech.audio.delta" and kinds[-1] == "error" and "speech.audio.done" not in kinds
    assert events[-1]["error"]["code"] == "shutting_down"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_serve(port: int, max_frames: int, drain_s: float) -> str:
    """The `higgs-stream serve` command line of a random tiny v2 model on the CPU (EOS suppressed: every segment is
    `max_frames` frames), listening on `port`."""
    return (f"{sys.executable} -m higgs_stream.cli serve --model random:tiny --device cpu --host 127.0.0.1 "
            f"--port {port} --max-frames {max_frames} --drain-timeout {drain_s:g} --no-warm-up")


async def close_code(lis: Peer) -> int:
    """Read the rest of a connection the server closes; its close code."""
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            lis.handle(await lis.ws.recv())
    return closed.value.rcvd.code


def test_sigterm_drains_a_served_stream_then_the_process_exits(tmp_path):
    """The real signal path (`higgs-stream serve`: serve_until_signalled): SIGTERM while a stream plays; the stream runs
    to its `done` with all its audio, the socket closes with 1001 and the process exits 0."""
    port = free_port()
    url = f"ws://127.0.0.1:{port}/v1/tts/stream"
    cmd = tiny_serve(port, max_frames=400, drain_s=60)
    with spawned_server(cmd, url, tmp_path / "server.log", timeout_s=120) as proc:
        async def listen() -> tuple[Peer, int]:
            async with connect(url) as ws:
                lis = protocol_peer(ws)
                await speak(ws, "a", "Hello there.", 3)
                await lis.until(lambda: lis.pcm.get("a"))
                proc.send_signal(signal.SIGTERM)
                return lis, await close_code(lis)

        lis, code = asyncio.run(listen())
        assert proc.wait(timeout=60) == 0
    assert code == 1001 and not lis.errors
    done = lis.done["a"]
    assert done["reason"] == "completed" and done["samples"] == 400 * 960 == len(lis.pcm["a"]) // 2  # no EOS
    assert "draining: 1 streams open" in (tmp_path / "server.log").read_text()  # the signal came mid-stream



def test_sigterm_keeps_listening_and_reading_while_it_drains(tmp_path):
    """`higgs-stream serve` (stream/server.py: serve_until_signalled): after SIGTERM it still listens (/healthz answers
    503 "draining") and still reads its connections: a new context gets `shutting_down`, an open context's `end` lets it
    finish with all its audio and a `cancel` ends one. aiohttp's own cleanup stops reading every connection before its
    shutdown hooks run: the `end` was lost, the context waited out the drain and failed (a probe)."""
    port = free_port()
    url = f"ws://127.0.0.1:{port}/v1/tts/stream"
    cmd = tiny_serve(port, max_frames=50, drain_s=60)
    with spawned_server(cmd, url, tmp_path / "server.log", timeout_s=120) as proc:
        async def draining(http: aiohttp.ClientSession) -> dict:
            async with asyncio.timeout(30):
                while True:  # polled: the signal is handled on the server's own time
                    async with http.get(f"http://127.0.0.1:{port}/healthz") as r:
                        if r.status == 503:
                            return await r.json()
                    await asyncio.sleep(0.02)

        async def scenario() -> tuple[Peer, Peer, dict, list[int]]:
            async with connect(url) as ws_a, connect(url) as ws_b, aiohttp.ClientSession() as http:
                a, b = protocol_peer(ws_a), protocol_peer(ws_b)
                await a.say("a", "Hello there.", 3, end=False)
                await b.say("b", "And you.", 4, end=False)
                for lis, cid in ((a, "a"), (b, "b")):  # each context's text spoken, the context still open
                    await lis.until(lambda: len(lis.pcm.get(cid, ())) == 2 * 50 * 960)
                proc.send_signal(signal.SIGTERM)
                health = await draining(http)
                await a.say("late", "Hi.", 5, end=False)
                await a.until(lambda: a.errors)
                await ws_b.send(json.dumps({"type": "cancel", "context_id": "b"}))
                await ws_a.send(json.dumps({"type": "end", "context_id": "a"}))
                await a.until(lambda: "a" in a.done, 30)
                await b.until(lambda: "b" in b.done, 30)
                return a, b, health, [await close_code(a), await close_code(b)]

        a, b, health, codes = asyncio.run(scenario())
        assert proc.wait(timeout=60) == 0
    assert health["status"] == "draining" and codes == [1001, 1001]
    assert [(e["code"], e["context_id"]) for e in a.errors] == [("shutting_down", "late")] and not b.errors
    assert a.done["a"]["reason"] == "completed" and a.done["a"]["samples"] == 50 * 960 == len(a.pcm["a"]) // 2
    assert b.done["b"]["reason"] == "cancelled"


@pytest.mark.parametrize("back_to_back", [False, True])
def test_a_second_signal_ends_the_drain_at_once(tmp_path, back_to_back):
    """SIGTERM, then SIGINT while a context is still open (its `end` never comes, the drain has 600 s): the open context
    ends with `shutting_down` + `done{error}` at once, the socket closes with 1001 and the process exits 0. Two sent
    back to back count as two (an Event set twice before its waiter woke had counted once: a probe)."""
    port = free_port()
    url = f"ws://127.0.0.1:{port}/v1/tts/stream"
    cmd = tiny_serve(port, max_frames=50, drain_s=600)
    log = tmp_path / "server.log"
    with spawned_server(cmd, url, log, timeout_s=120) as proc:
        async def scenario() -> tuple[Peer, int]:
            async with connect(url) as ws:
                lis = protocol_peer(ws)
                await lis.say("a", "Hello there.", 3, end=False)
                await lis.until(lambda: len(lis.pcm.get("a", ())) == 2 * 50 * 960)
                proc.send_signal(signal.SIGTERM)
                if not back_to_back:
                    async with asyncio.timeout(30):  # polled: the first signal is handled on the server's own time
                        while "draining: 1 streams open" not in log.read_text():
                            await asyncio.sleep(0.02)
                proc.send_signal(signal.SIGINT)
                await lis.until(lambda: "a" in lis.done, 30)
                return lis, await close_code(lis)

        lis, code = asyncio.run(scenario())
        assert proc.wait(timeout=30) == 0
    assert code == 1001 and [e["code"] for e in lis.errors] == ["shutting_down"]
    assert lis.done["a"]["reason"] == "error"
    assert "a second signal: the drain is cut short" in log.read_text()


def test_a_signal_during_the_warm_up_stops_the_process_at_once(tmp_path):
    """SIGINT while the warm-up utterance runs (1,500 frames: seconds on a CPU): one line and exit 130, no traceback;
    Python's KeyboardInterrupt there had aborted the process ("terminate called", exit 134: a probe)."""
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(tiny_serve(port, max_frames=1500, drain_s=60).replace(" --no-warm-up", "").split(),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "pipeline: serving v2 with" not in log.read_text():  # the engine is built: the warm-up starts
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 128 + signal.SIGINT
    finally:
        proc.kill()
    text = log.read_text()
    assert "higgs-stream serve: SIGINT: stopping now" in text and "warmed up" not in text
    assert "Traceback" not in text and "terminate called" not in text

async def test_the_asgi_lifespans_end_drains_for_the_time_it_is_given(engine, codec):
    """Under Ray Serve the replica's requests had Serve's graceful_shutdown_timeout_s to end, so its app drains for 0 s
    at the lifespan's end (stream/ray_app.py): a stream still open ends at once with shutting_down."""
    config = ServerConfig(port=0, admit_step_ratio=None)  # drain_s 600 in the config
    metrics = Metrics()
    state = ServerState(config, Pipeline(engine, codec, config, metrics),
                        VoiceLibrary.from_config(config, speakers=engine.policy.speakers), metrics)
    app = make_asgi_app(state, drain_s=0.0)
    inbox: asyncio.Queue = asyncio.Queue()
    started = asyncio.Event()

    async def send(message: dict) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()

    await inbox.put({"type": "lifespan.startup"})
    lifespan = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, send))
    async with asyncio.timeout(60):
        await started.wait()
    handle = state.pipeline.open(ContextOptions(voice=default_voice(), seed=1))
    handle.say("Hello there.")  # no close(): the stream stays open
    await inbox.put({"type": "lifespan.shutdown"})
    async with asyncio.timeout(30):
        await lifespan
    _, end = await collect(handle, timeout=5)
    assert end.reason == "error" and isinstance(end.error, ShuttingDownError)
    await pages_freed(engine)
