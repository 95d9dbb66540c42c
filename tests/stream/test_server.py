"""End to end over real sockets on loopback (tiny random checkpoint, CPU): WebSocket and HTTP audio
equal offline synthesis (s16 within 1 LSB); concurrent contexts are independent; cancel/disconnect free
KV pages; bad input gets typed errors and the connection and server stay up."""

from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import logging
import time

import aiohttp
import av
import numpy as np
import pytest
import soundfile as sf
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.request import GenerationRequest, SamplingParams
from higgs_stream.engine.synth import synthesize
from higgs_stream.stream import routes, server as server_mod
from higgs_stream.stream.adapter import to_s16le
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.encoders import Resampler, wav_header
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.stream.server import bound_port, serve
from higgs_stream.stream.server_state import ServerState
from higgs_stream.stream.voices import VoiceLibrary
from higgs_stream.testing import assert_pcm_close
from higgs_stream.testing_server import (LONG_SEED, LONG_TEXT, TRANSPORTS, Peer, ServerStarter, pages_freed,
                                         speak, tiny_codec_engine, tiny_reference)
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

MAX_FRAMES = 30

codec, engine = tiny_codec_engine(kv_pages=1024)
reference = tiny_reference(MAX_FRAMES)


@pytest.fixture(params=TRANSPORTS)
async def start_server(request, engine, codec):
    """start(**ServerConfig fields) -> ("127.0.0.1:PORT", state), on the aiohttp server or the
    ASGI app (uvicorn): one protocol implementation, the same tests on both transports."""
    start = ServerStarter(request.param, engine, codec, MAX_FRAMES)
    yield start
    await start.close()
    assert engine.num_active == 0 and engine.cache.allocator.num_used == 0, "KV pages leaked"



async def test_ws_and_http_equal_offline_synthesis(start_server, reference):
    host, state = await start_server()
    expected = reference("Hello there.", 3)
    assert len(expected) > 10_000
    async with connect(f"ws://{host}/v1/tts/stream", compression=None) as ws:
        lis = Peer(ws)
        await speak(ws, "a", "Hello there.", 3)
        await lis.until(lambda: "a" in lis.done)
        kinds = [e["type"] for e in lis.events]
        assert kinds == ["ready", "audio_start", "done"]
        assert lis.done["a"] == {"type": "done", "context_id": "a", "reason": "completed", "samples": len(expected) // 2}
        assert_pcm_close(bytes(lis.pcm["a"]), expected, what="ws binary")
    async with connect(f"ws://{host}/v1/tts/stream?audio=base64") as ws:
        lis = Peer(ws)
        await speak(ws, "b", "Hello there.", 3)
        await lis.until(lambda: "b" in lis.done)
        assert lis.events[0]["audio"] == "base64"
        assert_pcm_close(bytes(lis.pcm["b"]), expected, what="ws base64")
    body = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "seed": 3}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://{host}/v1/audio/speech", json={**body, "response_format": "pcm"}) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "audio/pcm;rate=24000;channels=1"
            assert_pcm_close(await r.read(), expected, what="http pcm")
        async with http.post(f"http://{host}/v1/audio/speech", json={**body, "response_format": "wav"}) as r:
            data = await r.read()
            assert r.headers["Content-Type"] == "audio/wav" and data[:44] == wav_header()
            assert_pcm_close(data[44:], expected, what="http wav")
            wav, sr = sf.read(io.BytesIO(data), dtype="int16")
            assert sr == 24000 and wav.tobytes() == data[44:]
        async with http.post(f"http://{host}/v1/audio/speech",
                             json={**body, "stream_format": "sse", "response_format": "pcm"}) as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            events = [json.loads(block[6:]) for block in (await r.text()).split("\n\n") if block]
        assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
        assert_pcm_close(b"".join(base64.b64decode(e["audio"]) for e in events[:-1]), expected, what="sse")
        usage = events[-1]["usage"]
        assert events[-1]["type"] == "speech.audio.done" and usage["output_tokens"] == len(expected) // 2 // 960
        assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] and usage["input_tokens"] > 0
        # no response_format: mp3, as OpenAI (the SDK's speech.mp3 example); the same audio decoded
        async with http.post(f"http://{host}/v1/audio/speech", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "audio/mpeg"
            mp3 = await r.read()
        with av.open(io.BytesIO(mp3)) as f:
            assert f.format.name == "mp3" and f.streams.audio[0].rate == 24000
            decoded = np.concatenate([fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)])
        # + LAME's 1105 priming samples, + at most one 576-sample frame of padding
        assert 0 <= len(decoded) - 1105 - len(expected) // 2 < 576, (len(decoded), len(expected) // 2)
        assert np.abs(decoded).max() > 0.01
    m = state.metrics
    assert m.requests.value(transport="ws", outcome="completed") == 2
    assert m.requests.value(transport="http", outcome="completed") == 4
    assert m.ttfa.count == 6 and m.errors.value(code="invalid_input") == 0


async def test_eight_contexts_on_four_connections(start_server, reference, engine):
    host, state = await start_server()
    jobs = {f"c{i}-{j}": (["Hello there.", LONG_TEXT][j], 1 + i * 2 + j) for i in range(4) for j in range(2)}
    expected = {cid: reference(text, seed) for cid, (text, seed) in jobs.items()}
    sockets = [await connect(f"ws://{host}/v1/tts/stream", compression=None) for _ in range(4)]
    try:
        listeners = [Peer(ws) for ws in sockets]
        for i, ws in enumerate(sockets):  # two contexts per connection, text for both before any audio
            for j in range(2):
                await ws.send(json.dumps({"type": "text", "context_id": f"c{i}-{j}", "text": jobs[f"c{i}-{j}"][0],
                                          "seed": jobs[f"c{i}-{j}"][1]}))
            for j in range(2):
                await ws.send(json.dumps({"type": "end", "context_id": f"c{i}-{j}"}))
        await asyncio.gather(*(lis.until(lambda lis=lis: len(lis.done) == 2) for lis in listeners))
    finally:
        for ws in sockets:
            await ws.close()
    for i, lis in enumerate(listeners):
        assert lis.errors == []
        order = [(e["type"], e["context_id"]) for e in lis.events if e["type"] in ("audio_start", "done")]
        got = {cid: bytes(pcm) for cid, pcm in lis.pcm.items()}
        for cid in (f"c{i}-0", f"c{i}-1"):
            assert lis.done[cid]["reason"] == "completed"
            assert_pcm_close(got.get(cid, b""), expected[cid], what=f"{cid} vs its offline synthesis")
            assert lis.max_gap.get(cid, 0.0) < 2.0, f"{cid} stalled {lis.max_gap[cid]:.2f} s"
        # FIFO: the first context's bracket closes before the second one opens
        starts = [c for t, c in order if t == "audio_start"]
        assert starts == sorted(starts)
        first_done = order.index(("done", f"c{i}-0"))
        assert all(order.index(("audio_start", c)) > first_done for c in starts if c.endswith("-1"))
    assert state.metrics.requests.value(transport="ws", outcome="completed") == 8
    await pages_freed(engine)


async def test_cancel_and_disconnect_only_affect_their_context(start_server, reference, engine):
    host, state = await start_server(max_frames=300)
    expected_b = reference("Hello there.", 3, max_frames=300)
    async with connect(f"ws://{host}/v1/tts/stream") as wa, connect(f"ws://{host}/v1/tts/stream") as wb:
        la, lb = Peer(wa), Peer(wb)
        await wa.send(json.dumps({"type": "text", "context_id": "long", "text": LONG_TEXT, "seed": LONG_SEED}))
        await la.until(lambda: len(la.pcm.get("long", b"")) > 0)
        assert engine.cache.allocator.num_used > 0
        await speak(wb, "b", "Hello there.", 3)
        steps = state.pipeline.steps
        t0 = time.monotonic()
        await wa.send(json.dumps({"type": "cancel", "context_id": "long"}))
        await la.until(lambda: "long" in la.done)
        assert time.monotonic() - t0 < 0.5 and la.done["long"]["reason"] == "cancelled"
        assert state.pipeline.steps - steps <= 2  # answered within a step
        await lb.until(lambda: "b" in lb.done)
        assert lb.done["b"]["reason"] == "completed"
        assert_pcm_close(bytes(lb.pcm["b"]), expected_b)
        await pages_freed(engine)
        # the cancelled connection is still usable
        await speak(wa, "again", "Hello there.", 3)
        await la.until(lambda: "again" in la.done)
        assert_pcm_close(bytes(la.pcm["again"]), expected_b)
    # abrupt disconnect mid-stream (no close handshake)
    ws = await connect(f"ws://{host}/v1/tts/stream")
    lis = Peer(ws)
    await ws.send(json.dumps({"type": "text", "context_id": "x", "text": LONG_TEXT, "seed": LONG_SEED}))
    await lis.until(lambda: len(lis.pcm.get("x", b"")) > 0)
    ws.transport.abort()
    await pages_freed(engine)
    # HTTP client leaving mid-body frees its stream too
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"http://{host}/v1/audio/speech", json={"input": LONG_TEXT, "seed": LONG_SEED})
        assert r.status == 200 and len(await r.content.readany()) > 0
        r.close()
    await pages_freed(engine)
    assert state.pipeline.active == 0
    requests = state.metrics.requests  # asked to stop vs went away: both transports tell them apart
    assert requests.value(transport="ws", outcome="cancelled") == 1
    assert requests.value(transport="ws", outcome="disconnected") == 1
    assert requests.value(transport="http", outcome="disconnected") == 1


async def test_bad_input_gets_typed_errors_and_connection_survives(start_server, reference):
    host, state = await start_server(max_message_bytes=4096)
    bad = [
        ("{not json", "bad_json", None),
        (json.dumps({"type": "shout", "context_id": "a"}), "unknown_type", "a"),
        (json.dumps({"type": "text", "context_id": "a", "text": "x" * 5000}), "too_large", None),  # not parsed
        (json.dumps({"type": "text", "context_id": "a", "text": ""}), "invalid_input", "a"),
        (json.dumps({"type": "text", "context_id": "a", "text": "Hi.", "voice": "nobody"}), "not_found", "a"),
        (json.dumps({"type": "text", "context_id": "a", "text": "Hi.",
                     "reference": {"audio": base64.b64encode(b"RIFFjunkWAVE" * 9).decode(), "transcript": "t"}}),
         "bad_audio", "a"),
        (json.dumps({"type": "flush", "context_id": "ghost"}), "not_found", "ghost"),
        (json.dumps({"type": "end", "context_id": "ghost"}), "not_found", "ghost"),
        (b"\x00\x01binary", "bad_json", None),
    ]
    async with connect(f"ws://{host}/v1/tts/stream") as ws:
        lis = Peer(ws)
        for raw, code, cid in bad:
            await ws.send(raw)
            n = len(lis.errors)
            await lis.until(lambda n=n: len(lis.errors) > n, timeout=5)
            err = lis.errors[-1]
            assert err["code"] == code and err.get("context_id") == cid and err["message"], err
        assert lis.done == {} and not lis.pcm  # nothing was created
        await speak(ws, "ok", "Hello there.", 3)
        await lis.until(lambda: "ok" in lis.done)
        assert_pcm_close(bytes(lis.pcm["ok"]), reference("Hello there.", 3))
    # over the hard limit (2x) the transport closes with 1009; the server stays up
    async with connect(f"ws://{host}/v1/tts/stream", max_size=None) as ws:
        await ws.send(json.dumps({"type": "text", "context_id": "a", "text": "y" * 9000}))
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                await ws.recv()
        assert closed.value.rcvd.code == 1009
    async with aiohttp.ClientSession() as http:
        url = f"http://{host}/v1/audio/speech"
        for body, status, code in [
            (b"not json", 400, "bad_json"),
            (json.dumps({"input": "Hi", "voice": "nobody"}).encode(), 400, "not_found"),
            (json.dumps({"input": "Hi", "speed": 2.0}).encode(), 400, "invalid_input"),
            (json.dumps({"input": "Hi", "reference_audio": base64.b64encode(b"junk" * 50).decode(),
                         "reference_text": "t"}).encode(), 400, "bad_audio"),
            (json.dumps({"input": "x" * 5000}).encode(), 413, "too_large"),
            (json.dumps({"input": "x" * 9000}).encode(), 413, "too_large"),  # over the hard limit too
        ]:
            async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == status, await r.text()
                err = (await r.json())["error"]
                assert err["code"] == code and err["message"] and err["type"] == "invalid_request_error"
        async with http.post(url, json={"input": "Hello there.", "seed": 3, "response_format": "pcm"}) as r:
            assert r.status == 200
            assert_pcm_close(await r.read(), reference("Hello there.", 3))
    assert state.metrics.errors.value(code="not_found") == 4


async def test_auth(start_server):
    host, _ = await start_server(token="s3cret")
    async with connect(f"ws://{host}/v1/tts/stream") as ws:
        err = json.loads(await ws.recv())
        assert err["type"] == "error" and err["code"] == "unauthorized"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1008
    async with connect(f"ws://{host}/v1/tts/stream?token=wrong") as ws:
        assert json.loads(await ws.recv())["code"] == "unauthorized"
    async with connect(f"ws://{host}/v1/tts/stream?token=s3cret") as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
    async with connect(f"ws://{host}/v1/tts/stream", additional_headers={"Authorization": "Bearer s3cret"}) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
    async with aiohttp.ClientSession() as http:
        url = f"http://{host}/v1/audio/speech"
        async with http.post(url, json={"input": "Hi."}) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
            assert r.headers["WWW-Authenticate"] == "Bearer"
        async with http.post(url, json={"input": "Hi.", "seed": 1}, headers={"Authorization": "Bearer s3cret"}) as r:
            assert r.status == 200
            await r.read()
        async with http.get(f"http://{host}/v1/voices") as r:
            assert r.status == 401
        async with http.get(f"http://{host}/healthz") as r:
            assert r.status == 200


async def test_busy_when_full(start_server):
    host, _ = await start_server(max_streams=1)
    async with connect(f"ws://{host}/v1/tts/stream") as ws, aiohttp.ClientSession() as http:
        lis = Peer(ws)
        await ws.send(json.dumps({"type": "text", "context_id": "hold", "text": "waiting for more"}))
        await ws.send(json.dumps({"type": "text", "context_id": "second", "text": "Hi."}))
        await lis.until(lambda: lis.errors)
        assert lis.errors[0]["code"] == "busy" and lis.errors[0]["context_id"] == "second"
        async with http.post(f"http://{host}/v1/audio/speech", json={"input": "Hi."}) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "busy"
        await ws.send(json.dumps({"type": "cancel", "context_id": "hold"}))
        await lis.until(lambda: "hold" in lis.done)
        async with http.post(f"http://{host}/v1/audio/speech", json={"input": "Hi.", "seed": 1}) as r:
            assert r.status == 200
            await r.read()
    assert "second" not in lis.done  # a rejected context never existed


async def test_health_metrics_voices_and_demo(start_server, tmp_path, monkeypatch):
    (tmp_path / "index.html").write_text("<html>demo</html>")
    (tmp_path / "app.js").write_text("console.log('hi')")
    monkeypatch.setattr(routes, "web_dir", lambda: tmp_path)
    gc.unfreeze()
    host, state = await start_server()
    assert state.config.gc_freeze and gc.get_freeze_count() > 10_000  # start-up's objects left out of collections
    gc.unfreeze()
    good_ref = io.BytesIO()
    sf.write(good_ref, 0.3 * np.sin(np.arange(4800) / 10.0), 24000, format="WAV")
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://{host}/v1/audio/speech", json={"input": "Hello there.", "seed": 3}) as r:
            await r.read()
        # a reference voice that encodes fine works end to end
        async with http.post(f"http://{host}/v1/audio/speech", json={
                "input": "Hello there.", "seed": 3, "reference_text": "A tone.",
                "reference_audio": base64.b64encode(good_ref.getvalue()).decode()}) as r:
            assert r.status == 200 and len(await r.read()) > 0
        async with http.get(f"http://{host}/healthz") as r:
            body = await r.json()
            assert r.status == 200 and body["status"] == "ok" and body["steps"] > 0 and body["max_streams"] == 32
            assert body["codec"] == {"cudnn": None, "native_check": None}  # a CPU codec: no cuDNN, no check
            assert body["linears"] == {}  # the CPU server's plain-torch RefRunner: no GEMV timed or chosen
        async with http.get(f"http://{host}/metrics") as r:
            text = await r.text()
            assert r.headers["Content-Type"].startswith("text/plain")
        lines = text.splitlines()
        assert "higgs_ttfa_seconds_count 2" in lines
        assert 'higgs_requests_total{transport="http",outcome="completed"} 2' in lines
        assert "higgs_active_streams 0" in lines
        assert any(line.startswith("higgs_gc_pause_seconds_count ") for line in lines)
        assert "higgs_gpu_memory_cap_bytes 0" in lines  # a CPU server: no GPU bound
        calls = next(int(line.split()[1]) for line in lines if line.startswith("higgs_codec_call_seconds_count "))
        assert calls >= 2  # two requests' audio, one call or more each
        assert "higgs_codec_backlog_frames 0" in lines  # every frame decoded once the requests ended
        waits = next(int(line.split()[1]) for line in lines
                     if line.startswith("higgs_codec_overdue_wait_seconds_count "))
        assert 1 <= waits <= calls  # each first chunk is due when it is made: its call holds an overdue job
        async with http.get(f"http://{host}/v1/voices") as r:
            voices = await r.json()
            assert voices["default"] == "default" and voices["aliases"]["alloy"] == "default"
        async with http.get(f"http://{host}/") as r:
            assert r.status == 200 and await r.text() == "<html>demo</html>"
        async with http.get(f"http://{host}/app.js") as r:
            assert r.status == 200 and await r.text() == "console.log('hi')"
        async with http.get(f"http://{host}/missing.js") as r:
            assert r.status == 404
    # an engine that stops stepping reports unhealthy
    await state.pipeline.stop()
    async with aiohttp.ClientSession() as http, http.get(f"http://{host}/healthz") as r:
        assert r.status == 503 and (await r.json())["status"] == "unhealthy"


async def test_idle_text_is_spoken_after_the_buffer_delay(start_server, reference):
    host, _ = await start_server()
    async with connect(f"ws://{host}/v1/tts/stream") as ws:
        lis = Peer(ws)
        await ws.send(json.dumps({"type": "config", "max_buffer_delay_ms": 300}))
        await ws.send(json.dumps({"type": "text", "context_id": "t", "text": "Hello", "seed": 3}))
        await ws.send(json.dumps({"type": "text", "context_id": "t", "text": " there."}))
        # no end, no flush: the writer's timer cuts the buffer once it has been idle
        await lis.until(lambda: len(lis.pcm.get("t", b"")) > 0, timeout=30)
        assert "t" not in lis.done
        await ws.send(json.dumps({"type": "end", "context_id": "t"}))
        await lis.until(lambda: "t" in lis.done)
        assert_pcm_close(bytes(lis.pcm["t"]), reference("Hello there.", 3))
        assert [e["type"] for e in lis.events][:2] == ["ready", "ready"]


async def test_idle_connection_is_closed_with_a_typed_error(start_server, reference):
    host, state = await start_server(idle_timeout_s=0.3)
    t0 = time.monotonic()  # before connecting: the server's idle clock starts later, never earlier
    async with connect(f"ws://{host}/v1/tts/stream") as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        err = json.loads(await ws.recv())
        assert err["type"] == "error" and err["code"] == "idle_timeout"
        assert 0.3 <= time.monotonic() - t0 < 3.0
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    # a connection whose context outlives the idle time is not cut while audio is pending; once its last context
    # is done its idle clock runs again (it did not: a probe's connection stayed open after its context's done)
    async with connect(f"ws://{host}/v1/tts/stream") as ws:
        listener = Peer(ws)
        await speak(ws, "c1", "Hello there.", seed=1)
        await listener.until(lambda: "c1" in listener.done)
        assert listener.done["c1"]["reason"] == "completed" and not listener.errors
        done_at = time.monotonic()
        await listener.until(lambda: listener.errors, timeout=5)
        assert listener.errors[0]["code"] == "idle_timeout" and "context_id" not in listener.errors[0]
        assert time.monotonic() - done_at < 3.0
        with pytest.raises(ConnectionClosed):
            await ws.recv()
        assert_pcm_close(bytes(listener.pcm["c1"]), reference("Hello there.", 1))
    assert 'higgs_errors_total{code="idle_timeout"} 2' in state.metrics.render()


async def test_v3_checkpoint_streams_equal_offline_synthesis(tiny_v3_ckpt):
    """The same service serves Higgs Audio v3: WebSocket and HTTP PCM equal `synthesize` within 1 LSB."""
    from higgs_stream.engine.models.registry import load_codec_for

    codec = load_codec_for(tiny_v3_ckpt)
    offline = Engine.from_pretrained(str(tiny_v3_ckpt), config=EngineConfig(kv_pages=256))
    req = GenerationRequest("Hello there.", sampling=SamplingParams(seed=5), max_frames=MAX_FRAMES)
    expected = to_s16le(synthesize(offline, codec, req)[0])
    assert len(expected) > 1000

    engine = Engine.from_pretrained(str(tiny_v3_ckpt), config=EngineConfig(kv_pages=256))
    config, metrics = ServerConfig(port=0, max_frames=MAX_FRAMES), Metrics()
    state = ServerState(config, Pipeline(engine, codec, config, metrics), VoiceLibrary.from_config(config), metrics)
    runner = await serve(state, "127.0.0.1", 0)
    try:
        host = f"127.0.0.1:{bound_port(runner)}"
        async with connect(f"ws://{host}/v1/tts/stream") as ws:
            lis = Peer(ws)
            await speak(ws, "v3", "Hello there.", 5)
            await lis.until(lambda: "v3" in lis.done)
            assert lis.done["v3"]["reason"] == "completed"
            assert_pcm_close(bytes(lis.pcm["v3"]), expected, what="v3 ws")
        async with aiohttp.ClientSession() as http:
            body = {"input": "Hello there.", "seed": 5, "response_format": "pcm"}
            async with http.post(f"http://{host}/v1/audio/speech", json=body) as r:
                assert r.status == 200
                assert_pcm_close(await r.read(), expected, what="v3 http")
    finally:
        await runner.cleanup()
    assert engine.cache.allocator.num_used == 0


async def test_http_speech_at_another_sample_rate_is_the_resampled_stream(start_server, reference):
    """`sample_rate` (our extension, PROTOCOL.md §2): the response is the 24 kHz stream resampled as
    it arrives, equal to resampling the offline synthesis in one go within 3 LSB (a 1-LSB input
    difference passes through the resampling filter; measured 1 here), at the headers' rate."""
    host, _ = await start_server()
    expected = reference("Hello there.", 3)
    body = {"input": "Hello there.", "seed": 3}
    async with aiohttp.ClientSession() as http:
        url = f"http://{host}/v1/audio/speech"
        for rate in (16000, 8000, 48000):
            whole = Resampler(rate)
            want = whole.feed(expected) + whole.flush()
            async with http.post(url, json={**body, "response_format": "pcm", "sample_rate": rate}) as r:
                assert r.status == 200 and r.headers["Content-Type"] == f"audio/pcm;rate={rate};channels=1"
                got = await r.read()
            lsb = assert_pcm_close(got, want, max_lsb=3, what=f"pcm at {rate} Hz")
            print(f"{rate} Hz: {len(got) // 2} samples for {len(expected) // 2} at 24 kHz, max {lsb} LSB from one-shot")
            assert abs(len(got) // 2 - len(expected) // 2 * rate / 24000) <= 1
        async with http.post(url, json={**body, "response_format": "wav", "sample_rate": 16000}) as r:
            data = await r.read()
        wav, sr = sf.read(io.BytesIO(data), dtype="int16")
        assert sr == 16000 and data[:44] == wav_header(16000) and abs(len(wav) - len(expected) // 2 * 2 / 3) <= 1
        async with http.post(url, json={**body, "response_format": "opus", "sample_rate": 44100}) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["code"] == "invalid_input"
            assert "use one of 8000, 16000, 24000, 48000" in err["message"], err


def test_startup_line_names_webrtc_when_mounted():
    from aiohttp import web

    app = web.Application()
    assert "no WebRTC" in server_mod.startup_line(app, "0.0.0.0", 8000)
    async def offer(request):
        return web.Response()

    app.router.add_post("/v1/webrtc/offer", offer)
    line = server_mod.startup_line(app, "0.0.0.0", 8000)
    assert line == ("serving on http://0.0.0.0:8000 (WebSocket /v1/tts/stream, POST /v1/audio/speech, "
                    "WebRTC POST /v1/webrtc/offer)")


async def test_client_pings_are_answered(start_server):
    """The server answers a client's ping on both transports (aiohttp's autoping is off: AiohttpSocket answers)."""
    host, _ = await start_server()
    async with connect(f"ws://{host}/v1/tts/stream", ping_interval=None) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        latency = await asyncio.wait_for(await ws.ping(), 5)
        assert latency >= 0


async def test_unparsable_requests_are_one_info_line(start_server, caplog):
    """A request line over aiohttp's 8190 bytes and a non-ASCII path: aiohttp's own 400, logged as one INFO line
    (an ERROR with a traceback each before, found by a probe); the server goes on. (The ASGI transport: uvicorn's
    parser answers and logs these itself, h11's and httptools' each their own way.)"""
    if start_server.transport != "aiohttp":
        pytest.skip("uvicorn's parser (the ASGI transport) answers and logs these itself")
    host, _ = await start_server()
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    name, port = host.rsplit(":", 1)
    for request in (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", b"GET /\xe9 HTTP/1.1\r\nHost: x\r\n\r\n"):
        reader, writer = await asyncio.open_connection(name, int(port))
        writer.write(request)
        reply = await reader.read(300)
        writer.close()
        assert reply.split(b"\r\n")[0].endswith(b" 400 Bad Request"), reply
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert len(records) == 2 and all(r.levelno == logging.INFO and r.exc_info is None for r in records), records
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{host}/healthz") as r:
            assert r.status == 200
