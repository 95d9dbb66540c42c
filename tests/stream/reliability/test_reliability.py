"""Reliability under hostile input (issue #11), end to end on loopback with the tiny checkpoint.

Rule 1 of PROTOCOL.md holds whatever a client sends: every accepted context ends with `done`
(after an `error` when it failed), a server-side failure closes the socket with 1011, and no
client can hold streams forever. One test per finding of the issue, then the fuzzers (Hypothesis
over the message schema on the sans-I/O session; seeded mutations of valid messages, HTTP bodies
and SDP offers against a live server); the soak is test_soak.py beside it, the live server conftest.py.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import io
import json
import os
import random
import threading
import zlib

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from higgs_stream.engine.errors import CapacityError
from higgs_stream.stream import http_speech
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.session import Open, Session
from higgs_stream.stream.voices import Voice, VoiceLibrary
from higgs_stream.testing import assert_pcm_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from higgs_stream.testing_server import WS_ERROR_CODES as ERROR_CODES
from higgs_stream.testing_server import protocol_peer as Peer
from higgs_stream.testing_server import wait_until as until


def tone_wav(seconds: float = 0.2, sr: int = 24000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, 0.3 * np.sin(np.arange(int(seconds * sr)) / 10.0), sr, format="WAV")
    return buf.getvalue()


async def raw_request(host: str, head: bytes, body: bytes = b"", timeout: float = 10.0) -> tuple[int, dict]:
    """Send bytes no HTTP client library would (non-UTF-8 headers, a body cut short); returns the
    status and the JSON body of the answer."""
    h, port = host.split(":")
    reader, writer = await asyncio.open_connection(h, int(port))
    try:
        writer.write(head + b"\r\n" + body)
        async with asyncio.timeout(timeout):
            status_and_headers = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in status_and_headers[1:] if ": " in line)}
            payload = await reader.readexactly(int(headers["content-length"]))
        assert headers["content-type"].startswith("application/json"), headers
        return int(status_and_headers[0].split()[1]), json.loads(payload)
    finally:
        writer.close()


async def raw_ws_frames(host: str, extra_headers: bytes) -> tuple[int, list[tuple[int, bytes]]]:
    """A WebSocket upgrade with raw header bytes; returns the HTTP status and the server's frames
    (opcode, payload) up to its close frame."""
    h, port = host.split(":")
    reader, writer = await asyncio.open_connection(h, int(port))
    try:
        writer.write(b"GET /v1/tts/stream HTTP/1.1\r\nHost: " + host.encode() + b"\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Key: " + base64.b64encode(os.urandom(16)) +
                     b"\r\nSec-WebSocket-Version: 13\r\n" + extra_headers + b"\r\n")
        frames = []
        async with asyncio.timeout(10):
            status = int((await reader.readuntil(b"\r\n\r\n")).split()[1])
            while status == 101:
                b0, b1 = await reader.readexactly(2)
                n = b1 & 0x7F
                if n >= 126:
                    n = int.from_bytes(await reader.readexactly(2 if n == 126 else 8), "big")
                frames.append((b0 & 0x0F, await reader.readexactly(n)))  # server frames are not masked
                if frames[-1][0] == 8:
                    break
        return status, frames
    finally:
        writer.close()


# ---------------------------------------------------------------- one test per finding


async def test_deep_json_and_lone_surrogates_fail_alone(start_server, reference):
    """JSON nested ~1000 deep raised RecursionError (WS closed 1000, the other contexts lost, HTTP a
    text/plain 500); a lone surrogate passed validation and killed the session in the tokenizer."""
    host, state = await start_server()
    deep = "[" * 1000 + "]" * 1000
    async with connect(f"ws://{host}/v1/tts/stream") as ws:
        peer = Peer(ws)
        await peer.say("a", "Hello there.", 3, end=False)
        await ws.send(deep)
        await ws.send(json.dumps({"type": "text", "context_id": "s", "text": "\ud800 hi"}))
        await ws.send(json.dumps({"type": "text", "context_id": "a", "text": " Bye.", "scene": "\udfff"}))
        await ws.send(json.dumps({"type": "end", "context_id": "a"}))
        await peer.until(lambda: peer.ended("a"))
        assert [(e["code"], e.get("context_id")) for e in peer.errors] == [
            ("bad_json", None), ("invalid_input", "s"), ("invalid_input", "a")]
        assert peer.dones["a"][0]["reason"] == "completed" and "s" not in peer.done
        assert_pcm_close(bytes(peer.pcm["a"]), reference("Hello there.", 3), what="context a")
    async with aiohttp.ClientSession() as http:
        url = f"http://{host}/v1/audio/speech"
        for body, code in [(deep.encode(), "bad_json"), (json.dumps({"input": "\ud800 hi"}).encode(), "invalid_input")]:
            async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == code
        async with http.post(url, json={"input": "Hello there.", "seed": 3, "response_format": "pcm"}) as r:
            assert r.status == 200
            assert_pcm_close(await r.read(), reference("Hello there.", 3), what="http")


async def test_non_utf8_authorization_is_unauthorized(start_server):
    """`Bearer \\xff\\xfe` made authorized() raise: HTTP 500, and on a WS upgrade 101 + close 1000."""
    host, _ = await start_server(token="s3cret")
    status, body = await raw_request(host, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                           b"\r\nAuthorization: Bearer \xff\xfe\r\nContent-Length: 2\r\n", b"{}")
    assert status == 401 and body["error"]["code"] == "unauthorized"
    status, frames = await raw_ws_frames(host, b"Authorization: Bearer \xff\xfe\r\n")
    assert status == 101 and json.loads(frames[0][1])["code"] == "unauthorized"
    assert frames[-1][0] == 8 and int.from_bytes(frames[-1][1][:2], "big") == 1008
    status, body = await raw_request(host, b"GET /v1/voices?token=%FF%FE HTTP/1.1\r\nHost: x\r\n")
    assert status == 401


async def test_a_failing_session_ends_its_contexts_and_closes_1011(start_server, monkeypatch, caplog):
    """A server bug mid-session: every accepted context still ends (`internal` + done), the socket
    closes 1011, not 1000; an HTTP handler's bug is a JSON 500, not aiohttp's text/plain page."""
    host, _ = await start_server()

    def broken_audio(self, context_id, pcm):
        raise RuntimeError("framing bug")

    monkeypatch.setattr(Session, "audio", broken_audio)
    monkeypatch.setattr(http_speech, "parse_speech", lambda *a: 1 / 0)
    async with connect(f"ws://{host}/v1/tts/stream") as ws:
        peer = Peer(ws)
        await peer.say("a", "Hello there.", 3)
        await peer.say("b", "Hi.", 4, end=False)
        with pytest.raises(ConnectionClosed) as closed:
            await peer.until(lambda: False)
        assert closed.value.rcvd.code == 1011
    assert {cid: [d["reason"] for d in ds] for cid, ds in peer.dones.items()} == {"a": ["error"], "b": ["error"]}
    assert {(e["code"], e["context_id"]) for e in peer.errors} == {("internal", "a"), ("internal", "b")}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://{host}/v1/audio/speech", json={"input": "Hi."}) as r:
            assert r.status == 500 and (await r.json())["error"]["code"] == "internal"
    monkeypatch.undo()
    # both bugs are logged with their traceback; the teardown's check is for unexpected ones
    assert sorted(type(r.exc_info[1]).__name__ for r in caplog.records if r.exc_info) == [
        "RuntimeError", "ZeroDivisionError"]
    caplog.clear()


async def test_reference_audio_is_checked_from_its_header_and_decoded_off_the_loop(
        start_server, monkeypatch, flac_announcing):
    """A 673 KB FLAC of 1 h was decoded whole on the event loop (every stream and /healthz stalled
    ~5 s, +1.3 GB) before its length was checked."""
    host, _ = await start_server()
    bomb = base64.b64encode(flac_announcing(3600 * 48000)).decode()
    real_decode, threads = Voice.decode, []
    started, release = threading.Event(), threading.Event()

    def slow_decode(self):
        threads.append(threading.current_thread().name)
        started.set()
        release.wait(30)
        return real_decode(self)

    monkeypatch.setattr(Voice, "decode", slow_decode)
    async with connect(f"ws://{host}/v1/tts/stream") as ws, aiohttp.ClientSession() as http:
        peer = Peer(ws)
        await peer.say("bomb", "Hi.", 1, reference={"audio": bomb, "transcript": "t"})
        await peer.until(lambda: peer.errors)
        assert peer.errors[0]["code"] == "bad_audio" and "announces 3600.00 s" in peer.errors[0]["message"]
        good = {"audio": base64.b64encode(tone_wav()).decode(), "transcript": "A tone."}
        await peer.say("ok", "Hi.", 1, reference=good)
        assert await asyncio.to_thread(started.wait, 30)
        async with asyncio.timeout(5), http.get(f"http://{host}/healthz") as r:  # the loop is free meanwhile
            assert r.status == 200
        release.set()
        await peer.until(lambda: peer.ended("ok"))
        assert peer.dones["ok"][0]["reason"] == "completed" and len(peer.pcm["ok"]) > 0
        async with http.post(f"http://{host}/v1/audio/speech", json={
                "input": "Hi.", "reference_audio": bomb, "reference_text": "t"}) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "bad_audio"
    assert threads == ["higgs-encode_0"] and "bomb" not in peer.done


async def test_idle_contexts_time_out_and_free_their_streams(start_server, reference):
    """One connection sending 4 `text` + `flush` and nothing else held `--max-streams 4` forever;
    a partial HTTP body was never timed out either."""
    host, state = await start_server(max_streams=4, context_idle_s=0.5, http_body_timeout_s=0.5)
    async with connect(f"ws://{host}/v1/tts/stream") as hog, connect(f"ws://{host}/v1/tts/stream") as ws:
        holder = Peer(hog)
        for i in range(4):
            await holder.say(f"h{i}", "Hi.", i, end=False, flush=True)
        await holder.until(lambda: len(holder.done) == 4, timeout=60)
        for i in range(4):
            (done,) = holder.dones[f"h{i}"]
            assert done["reason"] == "error"
        assert sorted(e["context_id"] for e in holder.errors if e["code"] == "idle_timeout") == ["h0", "h1", "h2", "h3"]
        peer = Peer(ws)  # the server is free again
        await peer.say("next", "Hello there.", 3)
        await peer.until(lambda: peer.ended("next"))
        assert_pcm_close(bytes(peer.pcm["next"]), reference("Hello there.", 3), what="after the timeouts")
        assert not peer.errors and peer.dones["next"][0]["reason"] == "completed"  # ended: no idle clock
    status, body = await raw_request(host, b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n"
                                           b"Content-Type: application/json\r\nContent-Length: 100\r\n", b'{"input": ')
    assert status == 408 and body["error"]["code"] == "timeout"
    assert state.metrics.errors.value(code="idle_timeout") == 4
    # counted as the errors they were, not as the client's cancels (a probe: outcome "cancelled" while the client
    # got done{reason:"error"})
    assert state.metrics.requests.value(transport="ws", outcome="error") == 4
    assert state.metrics.requests.value(transport="ws", outcome="cancelled") == 0


async def test_browser_origins_and_content_types(start_server):
    """No Origin check and text/plain bodies let any web page drive a token-less server."""
    host, _ = await start_server(allowed_origins=("https://app.example",))
    url = f"ws://{host}/v1/tts/stream"
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url, origin="https://evil.example"):
            pass
    assert refused.value.response.status_code == 403
    for origin in (None, f"http://{host}", "https://app.example"):  # non-browser, same origin, allowed
        async with connect(url, origin=origin) as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
    async with aiohttp.ClientSession() as http:
        speech = f"http://{host}/v1/audio/speech"
        for kwargs, status, code in [
            (dict(data=b'{"input": "Hi."}', headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type"),
            (dict(json={"input": "Hi."}, headers={"Origin": "https://evil.example"}), 403, "forbidden_origin"),
            (dict(json={"input": "Hi.", "seed": 1}, headers={"Origin": f"http://{host}"}), 200, None),
        ]:
            async with http.post(speech, **kwargs) as r:
                assert r.status == status
                if code:
                    assert (await r.json())["error"]["code"] == code
                else:
                    await r.read()


async def test_a_control_token_anywhere_in_the_input_is_refused_before_any_audio(start_server):
    """A chat control token in the last of 40 sentences: 400 invalid_input before the headers (a probe's request
    streamed 33 s of audio, then a truncated body: each segment was checked only as it started)."""
    host, state = await start_server()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://{host}/v1/audio/speech", json={
                "input": "Hello there. " * 40 + "Bye <|eot_id|> now.", "response_format": "pcm"}) as r:
            body = await r.json()
            assert r.status == 400 and body["error"]["code"] == "invalid_input", body
            assert "control tokens" in body["error"]["message"]
    assert state.pipeline.metrics.audio_seconds.value() == 0.0


@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
async def test_compressed_bodies_on_both_transports(start_server, encoding):
    """Content-Encoding gzip / deflate: a good body is read (uvicorn passed the compressed bytes on: bad_json there), a
    bomb past the message limit is too_large, a body that is not what it says (a probe's) is bad_json, not a 500 with
    two logged tracebacks (aiohttp's decoder). A stream cut short is a 400 too: aiohttp's parser answers it itself
    (text/plain, logged as one INFO line), uvicorn's bytes fail as JSON. The server goes on."""
    transport = start_server.transport
    host, state = await start_server()

    def compress(data: bytes) -> bytes:
        return gzip.compress(data) if encoding == "gzip" else zlib.compress(data)

    def head(body: bytes) -> bytes:
        return (f"POST /v1/audio/speech HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n").encode()

    for body, status, code in [(b'{"input": "Hi."}', 400, "bad_json"),  # not compressed at all
                               (compress(b"\0" * (state.config.hard_message_bytes + 1)), 413, "too_large")]:
        got, answer = await raw_request(host, head(body), body)
        assert got == status and answer["error"]["code"] == code, (got, answer)
    cut = compress(b'{"input": "Hi.", "seed": 1}')[:12]
    if transport == "asgi":
        got, answer = await raw_request(host, head(cut), cut)
        assert got == 400 and answer["error"]["code"] == "bad_json", answer
    else:
        reader, writer = await asyncio.open_connection(*host.split(":"))
        writer.write(head(cut) + b"\r\n" + cut)
        async with asyncio.timeout(10):
            assert (await reader.readuntil(b"\r\n")).split()[1] == b"400"
        writer.close()
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.post(f"http://{host}/v1/audio/speech", data=compress(b'{"input": "Hi.", "seed": 1}'),
                             headers={"Content-Type": "application/json", "Content-Encoding": encoding}) as r:
            assert r.status == 200 and len(await r.read()) > 0


async def test_unknown_paths_and_wrong_methods_get_json_errors(start_server):
    """aiohttp's default answered an empty octet-stream 404 (also for a wrong method)."""
    host, state = await start_server()
    async with aiohttp.ClientSession() as http:
        for method, path, status, code in [
            ("GET", "/v1/nope", 404, "not_found"),
            ("POST", "/v1/voices", 405, "method_not_allowed"),
            ("GET", "/v1/audio/speech", 405, "method_not_allowed"),
            ("DELETE", "/healthz", 405, "method_not_allowed"),
        ]:
            async with http.request(method, f"http://{host}{path}") as r:
                assert r.status == status and r.content_type == "application/json", (method, path, r.status)
                err = (await r.json())["error"]
                assert err["code"] == code and path in err["message"] and err["type"] == "invalid_request_error"
                if status == 405:
                    assert r.headers["Allow"], r.headers
    assert state.metrics.errors.value(code="method_not_allowed") == 3


async def test_cors_for_listed_origins_only(start_server):
    """A web app on another origin could not call /v1/audio/speech: no preflight, no CORS headers."""
    host, _ = await start_server(cors_origins=("https://web.example",))
    speech = f"http://{host}/v1/audio/speech"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    async with aiohttp.ClientSession() as http:
        async with http.options(speech, headers={"Origin": "https://web.example", **preflight}) as r:
            assert r.status == 204
            assert r.headers["Access-Control-Allow-Origin"] == "https://web.example"
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert "content-type" in r.headers["Access-Control-Allow-Headers"].lower()
        async with http.options(speech, headers={"Origin": "https://evil.example", **preflight}) as r:
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
            assert (await r.json())["error"]["code"] == "forbidden_origin"
        body = {"input": "Hi.", "seed": 1, "response_format": "pcm"}
        async with http.post(speech, json=body, headers={"Origin": "https://web.example"}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "https://web.example"
            assert len(await r.read()) > 0
        async with http.post(speech, json={"input": " "}, headers={"Origin": "https://web.example"}) as r:
            assert r.status == 400 and r.headers["Access-Control-Allow-Origin"] == "https://web.example"
        async with http.get(f"http://{host}/v1/voices", headers={"Origin": "https://web.example"}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "https://web.example"
        async with http.post(speech, json=body, headers={"Origin": "https://evil.example"}) as r:
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
        async with http.get(f"http://{host}/healthz", headers={"Origin": "https://web.example"}) as r:
            assert "Access-Control-Allow-Origin" not in r.headers  # only the API routes
    # a CORS-listed origin may open the WebSocket too; others still may not
    async with connect(f"ws://{host}/v1/tts/stream", origin="https://web.example") as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
    with pytest.raises(InvalidStatus):
        async with connect(f"ws://{host}/v1/tts/stream", origin="https://evil.example"):
            pass


async def test_kv_page_gauges_show_pages_in_use(start_server, engine):
    host, _ = await start_server(max_frames=300)

    async def gauges() -> tuple[int, int]:
        async with aiohttp.ClientSession() as http, http.get(f"http://{host}/metrics") as r:
            lines = dict(line.rsplit(" ", 1) for line in (await r.text()).splitlines() if not line.startswith("#"))
        return int(lines["higgs_kv_pages_used"]), int(lines["higgs_kv_pages_free"])

    assert await gauges() == (0, engine.cache.allocator.num_pages)
    async with connect(f"ws://{host}/v1/tts/stream") as ws:
        peer = Peer(ws)
        await peer.say("long", "A long sentence that keeps going.", 4, end=False, flush=True)
        await peer.until(lambda: peer.pcm.get("long"))
        used, free = await gauges()
        assert used > 0 and used + free == engine.cache.allocator.num_pages
        await ws.send(json.dumps({"type": "cancel", "context_id": "long"}))
        await peer.until(lambda: peer.ended("long"))
    async with asyncio.timeout(10):  # the gauge follows once the engine step that freed them ran
        while await gauges() != (0, engine.cache.allocator.num_pages):
            await asyncio.sleep(0.01)


# ---------------------------------------------------------------- fuzzing: the message schema (Hypothesis)

def _voices() -> VoiceLibrary:
    return VoiceLibrary(max_reference_s=2.0)


REF_AUDIO = st.sampled_from([base64.b64encode(tone_wav()).decode(), "AAAA", "@@", "", "data:audio/wav;base64,"])
TEXTS = st.one_of(st.text(max_size=30), st.sampled_from(["Hi.", "\ud800 hi", " ", "a" * 5000]))
IDS = st.one_of(st.sampled_from(["a", "b", "c"]), st.text(max_size=3), st.integers(), st.none())
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                       max_leaves=10)
FIELDS = {
    "voice": st.one_of(st.sampled_from(["default", "alloy", "nobody", ""]), JSONISH),
    "reference": st.one_of(st.fixed_dictionaries({"audio": REF_AUDIO, "transcript": TEXTS}), JSONISH),
    "mode": st.one_of(st.sampled_from(["exact", "low_latency", "fast"]), JSONISH),
    "seed": st.one_of(st.integers(min_value=-5, max_value=2**64), JSONISH),
    "temperature": st.one_of(st.floats(allow_nan=True), JSONISH),
    "top_k": st.one_of(st.integers(-2, 100), JSONISH), "top_p": st.one_of(st.floats(), JSONISH),
    "scene": st.one_of(TEXTS, JSONISH), "flush": st.one_of(st.booleans(), JSONISH),
    "audio": st.sampled_from(["binary", "base64", "hex"]), "sample_rate": st.sampled_from([24000, 16000, "x"]),
    "max_buffer_delay_ms": st.one_of(st.integers(-10, 20000), JSONISH), "bogus": JSONISH,
}
MESSAGES = st.one_of(
    st.builds(lambda kind, cid, text, opts: {"type": kind, "context_id": cid, "text": text, **opts},
              st.sampled_from(["text", "text", "flush", "end", "cancel", "config", "shout", 7]), IDS, TEXTS,
              st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=3).flatmap(
                  lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}))),
    JSONISH.map(lambda v: {"type": "text", "context_id": "a", "text": "x", "voice": v}),
)
WIRE = st.one_of(MESSAGES.map(lambda m: json.dumps(m)), st.binary(max_size=20),
                 st.text(max_size=20), st.sampled_from(["[" * 999 + "]" * 999, '{"type": "text"' + "," * 3]))


@settings(max_examples=150, deadline=None, derandomize=True, database=None,  # the same cases in every CI run
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(WIRE, max_size=12), st.randoms(use_true_random=False))
def test_any_message_sequence_keeps_rule_1(wire, rnd):
    """Whatever arrives: no exception, every reply a known typed error or a protocol message, and
    every context the session opened ends with exactly one `done` once the pipeline ends it."""
    voices = _voices()
    s = Session(ServerConfig(max_contexts=2), voices)
    opened: list[str] = []
    for now, raw in enumerate(wire):
        for cmd in s.receive(raw, float(now)) + s.tick(float(now)):
            if isinstance(cmd, Open):
                if rnd.random() < 0.2:
                    s.reject(cmd.context_id, CapacityError("full"))
                else:
                    opened.append(cmd.context_id)
        for cid in s.idle(float(now) + rnd.choice([0.0, 100.0])):
            s.time_out(cid)
    for cid in s.live:  # the pipeline ends what is left
        s.finished(cid, rnd.choice(["completed", "error"]))
    out = [json.loads(m) for m in s.outgoing() if isinstance(m, str)]
    assert all(m["code"] in ERROR_CODES and m["message"] for m in out if m["type"] == "error")
    assert {m["type"] for m in out} <= {"ready", "error", "done"}
    dones = [m["context_id"] for m in out if m["type"] == "done"]
    # an id may be reused after its done: each opening gets its own
    assert sorted(dones) == sorted(opened) and s.live == []


# ---------------------------------------------------------------- fuzzing: a live server (seeded mutations)

VALID = [
    {"type": "text", "context_id": "a", "text": "Hello there. ", "seed": 1},
    {"type": "text", "context_id": "b", "text": "Hi.", "flush": True, "voice": "alloy", "mode": "low_latency"},
    {"type": "config", "audio": "binary", "max_buffer_delay_ms": 200, "seed": 2},
    {"type": "flush", "context_id": "a"}, {"type": "end", "context_id": "b"}, {"type": "cancel", "context_id": "a"},
    {"type": "text", "context_id": "r", "text": "Hi.", "reference": {"audio": "UklGRg==", "transcript": "t"}},
]
NASTY = [None, True, -1, 2**70, 1e309, "", "\ud800", "x" * 3000, [], {}, [[[[[]]]]], {"a": {"b": {}}}, "end"]


def mutate(rnd: random.Random, msg: dict) -> str | bytes:
    """One mutation of a valid message, as the client would put it on the wire."""
    msg = json.loads(json.dumps(msg))
    op = rnd.randrange(9)
    key = rnd.choice(sorted(msg))
    if op == 0:
        del msg[key]
    elif op == 1:
        msg[key] = rnd.choice(NASTY)
    elif op == 2:
        msg[rnd.choice(["bogus", "temperature", "top_k", "top_p", "scene", "voice", "reference"])] = rnd.choice(NASTY)
    elif op == 3:
        msg[key] = "[" * 600 + "]" * 600
    elif op == 4:
        return json.dumps(msg)[: rnd.randrange(1, len(json.dumps(msg)))]  # truncated
    elif op == 5:
        return "[" * rnd.choice([50, 1000, 5000]) + "]" * rnd.choice([0, 1000])
    elif op == 6:
        raw = bytearray(json.dumps(msg).encode())
        raw[rnd.randrange(len(raw))] = rnd.randrange(256)
        return bytes(raw) if rnd.random() < 0.3 else raw.decode("utf-8", "replace")
    elif op == 7:
        msg = {"type": rnd.choice(["text", "flush", "end", "cancel", "config"]), **{k: rnd.choice(NASTY) for k in msg}}
    return json.dumps(msg)


async def test_live_server_fuzz(start_server, reference):
    """Seeded mutations of valid messages over one WebSocket, then HTTP bodies and headers: every
    case answered (typed errors only), no traceback logged, every context the fuzz created ends,
    and the next request is served correctly."""
    host, state = await start_server(max_frames=8, max_contexts=4, context_idle_s=1.0)
    rnd = random.Random(11)
    probe = json.dumps({"type": "flush", "context_id": "probe"})  # always not_found: marks "all answered"
    async with connect(f"ws://{host}/v1/tts/stream", max_size=None) as ws:
        peer = Peer(ws)
        for _ in range(500):
            n = len(peer.errors)  # before sending: the probe's answer may arrive while send() awaits
            await ws.send(mutate(rnd, rnd.choice(VALID)))
            await ws.send(probe)
            await peer.until(lambda n=n: any(e.get("context_id") == "probe" for e in peer.errors[n:]), timeout=30)
        n = len(peer.errors)
        for cid in "abr":
            await ws.send(json.dumps({"type": "cancel", "context_id": cid}))
        await ws.send(probe)
        await peer.until(lambda: any(e.get("context_id") == "probe" for e in peer.errors[n:]))
    codes = {e["code"] for e in peer.errors}
    assert {"bad_json", "invalid_input", "not_found"} <= codes <= ERROR_CODES
    await until(lambda: state.pipeline.active == 0)  # every context the fuzz created has ended
    async with connect(f"ws://{host}/v1/tts/stream") as ws:  # (a fresh session: the fuzz sent configs)
        peer = Peer(ws)
        await peer.say("ok", "Hello there.", 3)
        await peer.until(lambda: peer.ended("ok"))
        assert_pcm_close(bytes(peer.pcm["ok"]), reference("Hello there.", 3, 8), what="after the fuzz")
    async with aiohttp.ClientSession() as http:
        url = f"http://{host}/v1/audio/speech"
        for _ in range(60):
            body = mutate(rnd, {"input": "Hi.", "voice": "alloy", "seed": 1, "response_format": "pcm"})
            async with http.post(url, data=body if isinstance(body, bytes) else body.encode(),
                                 headers={"Content-Type": "application/json"}) as r:
                if r.status == 200:
                    await r.read()
                    continue
                err = (await r.json())["error"]
                assert r.status in (400, 413, 503) and err["code"] in ERROR_CODES, (r.status, err)
        async with http.post(url, json={"input": "Hello there.", "seed": 3, "response_format": "pcm"}) as r:
            assert_pcm_close(await r.read(), reference("Hello there.", 3, 8), what="http after the fuzz")


async def test_a_closed_connection_is_freed_without_a_garbage_collection(start_server):
    """Every object of a finished WebSocket session goes when its last reference does (a probe found the session's
    error callback, a method of its runner, made a cycle: 37-64 closed sessions waited for each collection)."""
    import gc

    host, state = await start_server()
    gc.collect()
    gc.disable()
    try:
        async with connect(f"ws://{host}/v1/tts/stream") as ws:
            peer = Peer(ws)
            await peer.say("a", "Hi.", 1)
            await ws.send(json.dumps({"type": "nonsense"}))  # an error counted through the session's callback
            await peer.until(lambda: peer.ended("a") and peer.errors)
        await until(lambda: len(state.sessions) == 0, timeout=10)
    finally:
        gc.enable()
