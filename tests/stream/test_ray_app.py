"""Ray Serve (stream/ray_app.py) on a local Ray instance: two replicas of the tiny checkpoint on the
CPU, one Ray instance for the module, loopback only, every wait bounded.

Through Serve's proxy: the WebSocket and HTTP protocols give what the standalone server gives
(PCM equal to offline synthesis within 1 LSB, typed errors, auth, JSON 404/405, the replica's own
`busy`); streams spread over both replicas; a `cancel` and a disconnect free the engine stream on
the replica that ran it; no Nagle stall on small frames; over capacity is `busy`/503 at once, never
a hang; killing a replica mid-stream ends its connections with `error{internal}` + 1011 within 2 s
while the other replica's streams finish intact and new requests succeed; scaling 2 -> 1 drains
without cutting a stream.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import statistics
import time
import urllib.request
import warnings

import aiohttp
import pytest

with warnings.catch_warnings():  # Ray's own use of pydantic warns at import
    warnings.simplefilter("ignore", DeprecationWarning)
    ray = pytest.importorskip("ray", reason="Ray Serve is the optional `ray` extra: pip install 'higgs-stream[ray]'")
    from ray import serve  # noqa: E402

from higgs_stream.engine.codec import load_codec  # noqa: E402
from higgs_stream.engine.engine import Engine, EngineConfig  # noqa: E402
from higgs_stream.engine.request import GenerationRequest, SamplingParams  # noqa: E402
from higgs_stream.engine.synth import synthesize  # noqa: E402
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from higgs_stream.stream import ray_app  # noqa: E402
from higgs_stream.stream.adapter import to_s16le  # noqa: E402
from higgs_stream.stream.encoders import wav_header  # noqa: E402
from higgs_stream.testing import assert_pcm_close  # noqa: E402
from higgs_stream.testing_server import LONG_SEED, LONG_TEXT  # noqa: E402
from higgs_stream.testing_server import Peer as WsPeer  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402

TOKEN = "s3cret"
MAX_FRAMES = 300
MAX_STREAMS = 4  # per replica: Serve's max_ongoing_requests and the replica's own admission
FLAGS = {"device": "cpu", "max_streams": MAX_STREAMS, "max_frames": MAX_FRAMES, "kv_pages": 1024,
         "admit_step_ratio": 0, "max_message_bytes": 4096, "token": TOKEN, "gpus_per_replica": 0,
         "cpus_per_replica": 0, "max_queued": 1, "drain_timeout": 30}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray (2 CPUs, 256 MiB object store, no dashboard) with Serve on a loopback port;
    Serve's proxies get our middleware. Yields (HTTP port, Prometheus port). Ray's workers run the
    stock asyncio loop (RAY_USE_UVLOOP=0): uvloop sets TCP_NODELAY itself, asyncio only on sockets
    made with IPPROTO_TCP, which Serve's proxy does not make; the proxy middleware sets it."""
    env = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_USE_UVLOOP": "0",
           ray_app.PROXY_CALLBACK_ENV: ray_app.PROXY_CALLBACK}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    metrics_port, port = free_port(), free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20,
             logging_level="WARNING", log_to_driver=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port, metrics_port
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def deploy(tiny_ckpt, replicas: int) -> None:
    serve.run(ray_app.build_app({"model": str(tiny_ckpt), "replicas": replicas, **FLAGS}), name=ray_app.APP_NAME,
              route_prefix="/")


@pytest.fixture(scope="module")
def base(cluster, tiny_ckpt) -> str:
    """The app with two replicas (max_message_bytes lowered to 4096 as in test_server's bad-input test)."""
    deploy(tiny_ckpt, 2)
    return f"127.0.0.1:{cluster[0]}"


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """s16le of engine.synth.synthesize for (text, seed), cached."""
    codec = load_codec(tiny_ckpt / "audio_tokenizer")
    eng = Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(kv_pages=512))
    cache: dict = {}

    def pcm(text: str, seed: int) -> bytes:
        if (text, seed) not in cache:
            req = GenerationRequest(text, sampling=SamplingParams(seed=seed), max_frames=MAX_FRAMES)
            cache[text, seed] = to_s16le(synthesize(eng, codec, req)[0])
        return cache[text, seed]

    return pcm


def replicas() -> tuple[set[str], int]:
    """(ids of the live replica actors, replicas RUNNING while the deployment is HEALTHY, else -1)."""
    prefix = f"SERVE_REPLICA::{ray_app.APP_NAME}#TTSReplica#"
    ids = {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
           if a["name"].startswith(prefix)}
    status = serve.status().applications[ray_app.APP_NAME].deployments["TTSReplica"]
    return ids, status.replica_states.get("RUNNING", 0) if status.status == "HEALTHY" else -1


async def until_replicas(n: int, gone: str | None = None, timeout: float = 90.0) -> None:
    """Until `n` replicas run (and `gone`, a replica that was killed, is not one of them)."""
    async with asyncio.timeout(timeout):
        while True:
            ids, running = await asyncio.to_thread(replicas)
            if running == n == len(ids) and gone not in ids:
                return
            await asyncio.sleep(0.2)


class Peer(WsPeer):
    """One WebSocket (higgs_stream/testing_server.py), plus the replica that serves it and how it closed."""

    def __init__(self, ws):
        super().__init__(ws)
        self.replica = ws.response.headers.get(ray_app.REPLICA_HEADER)
        self.closed_at: float | None = None
        self.close_code: int | None = None

    async def until_closed(self, timeout: float = 60.0) -> None:
        try:
            await self.until(lambda: False, timeout)
        except ConnectionClosed as e:
            self.closed_at, self.close_code = time.monotonic(), e.rcvd.code if e.rcvd else None


async def open_peer(base: str, query: str = "") -> Peer:
    ws = await asyncio.wait_for(connect(f"ws://{base}/v1/tts/stream?token={TOKEN}{query}", compression=None,
                                        max_size=None), 30)
    return Peer(ws)


async def peers_on_both(base: str, per_replica: int = 1, tries: int = 24) -> dict[str, list[Peer]]:
    """Open connections until each of the two replicas holds `per_replica` of them (routing is
    random: power of two choices); the others are closed."""
    by: dict[str, list[Peer]] = {}
    extra = []
    for _ in range(tries):
        peer = await open_peer(base)
        group = by.setdefault(peer.replica, [])
        (group if len(group) < per_replica else extra).append(peer)
        if len(by) == 2 and all(len(g) >= per_replica for g in by.values()):
            break
    for peer in extra:
        await peer.ws.close()
    assert len(by) == 2 and all(len(g) >= per_replica for g in by.values()), {k: len(v) for k, v in by.items()}
    return by


async def replica_metrics(http, base: str, replica: str, timeout: float = 20.0) -> dict[str, float]:
    """/metrics of one replica: ask until the proxy routes the request there."""
    async with asyncio.timeout(timeout):
        while True:
            async with http.get(f"http://{base}/metrics") as r:
                if r.headers.get(ray_app.REPLICA_HEADER) == replica:
                    text = await r.text()
                    return {k: float(v) for k, v in (l.rsplit(" ", 1) for l in text.splitlines() if l and l[0] != "#")}


async def replica_settles(http, base: str, replica: str, pred, timeout: float = 20.0) -> dict[str, float]:
    async with asyncio.timeout(timeout):
        while not pred(m := await replica_metrics(http, base, replica)):
            pass
    return m


def free(m: dict[str, float]) -> bool:
    return m["higgs_engine_streams"] == 0 and m["higgs_kv_pages_used"] == 0 and m["higgs_active_streams"] == 0


# ---------------------------------------------------------------- without a cluster: flags, options, the proxy guard

def serve_args(*argv: str):
    import argparse

    from higgs_stream.stream.serve_command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "m", *argv])


def test_deployment_options_follow_the_flags():
    opts = ray_app.deployment_options(serve_args("--max-streams", "256"), cluster_gpus=2)
    assert opts["num_replicas"] == 2 and opts["ray_actor_options"] == {"num_gpus": 1, "num_cpus": 1.0}
    assert (opts["max_ongoing_requests"], opts["max_queued_requests"], opts["graceful_shutdown_timeout_s"]) == (256, 64, 600)
    opts = ray_app.deployment_options(serve_args("--max-streams", "100", "--replicas", "2", "--max-replicas", "6"), 4)
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"] == {"min_replicas": 2, "initial_replicas": 2, "max_replicas": 6,
                                          "target_ongoing_requests": 70.0, "upscale_delay_s": 30.0,
                                          "downscale_delay_s": 600.0}
    cpu = ray_app.deployment_options(serve_args(), cluster_gpus=0)
    assert cpu["num_replicas"] == 1 and cpu["ray_actor_options"]["num_gpus"] == 0


def test_command_line_flags_reach_the_replicas():
    args = serve_args("--ray", "--replicas", "2", "--port", "9000", "--max-streams", "8", "--voice-alias", "a=b")
    flags = ray_app.given_flags(args)
    assert flags == {"model": "m", "replicas": 2, "max_streams": 8, "voice_alias": ["a=b"]}  # not the proxy's port
    argv = ray_app.flags_to_argv({**flags, "no_cuda_graphs": True, "token": None})  # as a replica gets them
    again = serve_args(*argv)
    assert (again.model, again.max_streams, again.voice_alias, again.no_cuda_graphs, again.token) == (
        "m", 8, ["a=b"], True, None) and "--token" not in argv


async def run_guard(scope: dict, app, client: list[dict]) -> list[dict]:
    """What ProxyGuard sends to the client when `app` (Serve's proxy app) answers `scope`."""
    sent, incoming = [], list(client)

    async def receive() -> dict:
        return incoming.pop(0) if incoming else await asyncio.Event().wait()

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(ray_app.ProxyGuard(app)(scope, receive, send), 5)
    return sent


WS_SCOPE = {"type": "websocket", "path": "/v1/tts/stream", "extensions": {"websocket.http.response": {}}}


async def test_proxy_guard_refused_upgrade_is_busy():
    async def serve_backpressure(scope, receive, send):  # what Serve's proxy does when its queue is full
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"Request dropped due to backpressure"})

    start, body = await run_guard(WS_SCOPE, serve_backpressure, [])
    assert start["type"] == "websocket.http.response.start" and start["status"] == 503
    assert (b"retry-after", b"1") in start["headers"]
    assert json.loads(body["body"])["error"]["code"] == "busy"
    (close,) = await run_guard({**WS_SCOPE, "extensions": {}}, serve_backpressure, [])
    assert close == {"type": "websocket.close", "code": 1013}


async def test_proxy_guard_ends_a_connection_whose_replica_died():
    async def dies_after_accept(scope, receive, send):
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": '{"type":"ready"}'})

    accept, ready, error, close = await run_guard(WS_SCOPE, dies_after_accept, [])
    assert json.loads(error["text"])["code"] == "internal" and close["code"] == 1011

    async def client_left(scope, receive, send):
        await send({"type": "websocket.accept"})
        assert (await receive())["type"] == "websocket.disconnect"

    assert [m["type"] for m in await run_guard(WS_SCOPE, client_left, [{"type": "websocket.disconnect"}])] == [
        "websocket.accept"]  # nothing is sent to a client that left

    async def closes(scope, receive, send):
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})

    assert [m.get("code") for m in await run_guard(WS_SCOPE, closes, [])] == [None, 1000]


async def test_proxy_guard_makes_serves_own_http_errors_typed():
    async def plain(status):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"oops", "more_body": False})
        return app

    for status, code in ((503, "busy"), (500, "internal")):
        start, body = await run_guard({"type": "http", "path": "/v1/audio/speech"}, await plain(status), [])
        assert start["status"] == status and json.loads(body["body"])["error"]["code"] == code

    async def json_busy(scope, receive, send):  # the replica's own busy passes untouched
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error":{"code":"busy"}}'})

    assert (await run_guard({"type": "http"}, json_busy, []))[1]["body"] == b'{"error":{"code":"busy"}}'

    async def sse_cut(scope, receive, send):  # a replica dying mid server-sent-events stream
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    *_, last = await run_guard({"type": "http"}, sse_cut, [])
    assert json.loads(last["body"][6:])["type"] == "error" and last["more_body"] is False


# ---------------------------------------------------------------- the protocols, through Serve

async def test_protocols_through_serve(base, reference):
    """test_server's protocol assertions, through Serve's proxy to two replicas."""
    expected = reference("Hello there.", 3)
    assert len(expected) > 10_000
    peer = await open_peer(base)
    async with peer.ws:
        await peer.say("a", "Hello there.", 3)
        await peer.until(lambda: "a" in peer.done)
        assert [e["type"] for e in peer.events] == ["ready", "audio_start", "done"]
        assert peer.done["a"] == {"type": "done", "context_id": "a", "reason": "completed", "samples": len(expected) // 2}
        assert_pcm_close(bytes(peer.pcm["a"]), expected, what="ws binary via serve")
    peer = await open_peer(base, "&audio=base64")
    async with peer.ws:
        await peer.say("b", "Hello there.", 3)
        await peer.until(lambda: "b" in peer.done)
        assert peer.events[0]["audio"] == "base64"
        assert_pcm_close(bytes(peer.pcm["b"]), expected, what="ws base64 via serve")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    body = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "seed": 3}
    url = f"http://{base}/v1/audio/speech"
    async with aiohttp.ClientSession(headers=auth) as http:
        async with http.post(url, json={**body, "response_format": "pcm"}) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "audio/pcm;rate=24000;channels=1"
            assert r.headers[ray_app.REPLICA_HEADER]
            assert_pcm_close(await r.read(), expected, what="http pcm via serve")
        async with http.post(url, json={**body, "response_format": "wav"}) as r:
            data = await r.read()
            assert r.headers["Content-Type"] == "audio/wav" and data[:44] == wav_header()
            assert_pcm_close(data[44:], expected, what="http wav via serve")
        async with http.post(url, json={**body, "stream_format": "sse", "response_format": "pcm"}) as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            events = [json.loads(block[6:]) for block in (await r.text()).split("\n\n") if block]
        assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
        assert_pcm_close(b"".join(base64.b64decode(e["audio"]) for e in events[:-1]), expected, what="sse via serve")
        assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] == len(expected) // 1920
        async with http.post(url, json=body) as r:  # mp3 by default, as OpenAI
            assert r.status == 200 and r.headers["Content-Type"] == "audio/mpeg" and len(await r.read()) > 1000
        # typed HTTP errors (PROTOCOL.md §3), also from Serve's own routing (404/405 come from a replica)
        for payload, status, code in [
            (b"not json", 400, "bad_json"),
            (json.dumps({"input": "Hi", "voice": "nobody"}).encode(), 400, "not_found"),
            (json.dumps({"input": "Hi", "speed": 2.0}).encode(), 400, "invalid_input"),
            (json.dumps({"input": "x" * 5000}).encode(), 413, "too_large"),
            (json.dumps({"input": "x" * 9000}).encode(), 413, "too_large"),  # over the hard limit too
        ]:
            async with http.post(url, data=payload, headers={"Content-Type": "application/json"}) as r:
                assert r.status == status, await r.text()
                assert (await r.json())["error"]["code"] == code
        for method, path, status, code in [("GET", "/v1/nope", 404, "not_found"), ("GET", "/v1/audio/speech", 405,
                                                                                    "method_not_allowed")]:
            async with http.request(method, f"http://{base}{path}") as r:
                assert r.status == status and (await r.json())["error"]["code"] == code
        async with http.get(f"http://{base}/v1/voices") as r:
            assert r.status == 200 and (await r.json())["aliases"]["alloy"] == "default"
        async with http.get(f"http://{base}/healthz") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
    async with aiohttp.ClientSession() as http:  # no token
        async with http.post(url, json={"input": "Hi."}) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
    async with connect(f"ws://{base}/v1/tts/stream") as ws:
        assert json.loads(await ws.recv())["code"] == "unauthorized"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1008
    # typed WebSocket errors; the connection survives them; over the hard limit: close 1009
    peer = await open_peer(base)
    async with peer.ws:
        bad = [("{not json", "bad_json", None), (json.dumps({"type": "shout", "context_id": "a"}), "unknown_type", "a"),
               (json.dumps({"type": "text", "context_id": "a", "text": "x" * 5000}), "too_large", None),
               (json.dumps({"type": "text", "context_id": "a", "text": "Hi.", "voice": "nobody"}), "not_found", "a"),
               (json.dumps({"type": "end", "context_id": "ghost"}), "not_found", "ghost"), (b"\x00\x01", "bad_json", None)]
        for raw, code, cid in bad:
            n = len(peer.errors)
            await peer.ws.send(raw)
            await peer.until(lambda n=n: len(peer.errors) > n, timeout=10)
            assert (peer.errors[-1]["code"], peer.errors[-1].get("context_id")) == (code, cid)
        # the replica's own admission (second guard): a fifth context on a replica of four streams
        for i in range(MAX_STREAMS + 1):
            await peer.say(f"h{i}", "waiting for more", i, end=False)
        await peer.until(lambda: any(e["code"] == "busy" for e in peer.errors), timeout=10)
        assert [e["context_id"] for e in peer.errors if e["code"] == "busy"] == [f"h{MAX_STREAMS}"]
        for i in range(MAX_STREAMS):
            await peer.ws.send(json.dumps({"type": "cancel", "context_id": f"h{i}"}))
        await peer.until(lambda: len(peer.done) == MAX_STREAMS, timeout=10)
        await peer.say("ok", "Hello there.", 3)
        await peer.until(lambda: "ok" in peer.done)
        assert_pcm_close(bytes(peer.pcm["ok"]), expected, what="after the errors")
        await peer.ws.send(json.dumps({"type": "text", "context_id": "a", "text": "y" * 9000}))
        await peer.until_closed(timeout=10)
        assert peer.close_code == 1009


async def test_streams_spread_and_cancel_or_disconnect_free_the_right_replica(base, reference, cluster):
    by = await peers_on_both(base)
    (ra, (a,)), (rb, (b,)) = sorted(by.items())
    expected = reference("Hello there.", 3)
    async with aiohttp.ClientSession() as http:
        before = {r: await replica_metrics(http, base, r) for r in (ra, rb)}
        # a long stream on A is cancelled while B's stream goes on
        await a.say("long", LONG_TEXT, LONG_SEED, end=False, flush=True)
        await b.say("b", "Hello there.", 3)
        await a.until(lambda: len(a.pcm.get("long", b"")) > 0)
        t0 = time.monotonic()
        await a.ws.send(json.dumps({"type": "cancel", "context_id": "long"}))
        await a.until(lambda: "long" in a.done)
        assert a.done["long"]["reason"] == "cancelled" and time.monotonic() - t0 < 0.5
        await b.until(lambda: "b" in b.done)
        assert b.done["b"]["reason"] == "completed"
        assert_pcm_close(bytes(b.pcm["b"]), expected, what="B beside A's cancel")
        # a client of B leaves mid-stream without a close handshake
        await b.say("x", LONG_TEXT, LONG_SEED)
        await b.until(lambda: len(b.pcm.get("x", b"")) > 0)
        b.ws.transport.abort()
        await a.ws.close()
        for replica, outcome in ((ra, "cancelled"), (rb, "disconnected")):  # each replica freed its own stream: no
            key = f'higgs_requests_total{{transport="ws",outcome="{outcome}"}}'  # engine stream, no KV page left
            m = await replica_settles(http, base, replica, lambda m, r=replica, k=key: free(m)
                                      and m.get(k, 0) == before[r].get(k, 0) + 1)
            assert m["higgs_kv_pages_used"] == 0
    # each replica's metrics reach Ray's Prometheus endpoint, tagged with the replica
    async with asyncio.timeout(30):
        while True:
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{cluster[1]}/metrics", timeout=5).read().decode())
            tagged = {r for r in (ra, rb) if any(l.startswith("ray_higgs_requests_total{") and f'replica="{r}"' in l
                                                 for l in text.splitlines())}
            if tagged == {ra, rb}:
                break
            await asyncio.sleep(0.5)


async def test_small_frames_are_not_held_by_nagle(base):
    """Two client messages, two small replies, 30 times: with Nagle on the proxy's sockets every
    round waits for the client's delayed ACK (40 ms); without, a few ms."""
    peer = await open_peer(base)
    async with peer.ws:
        await peer.until(lambda: peer.events)  # ready
        rounds = []
        for _ in range(30):
            t0 = time.monotonic()
            n = len(peer.errors)
            for _ in range(2):
                await peer.ws.send(json.dumps({"type": "flush", "context_id": "ghost"}))
            await peer.until(lambda n=n: len(peer.errors) == n + 2, timeout=10)
            rounds.append(time.monotonic() - t0)
    assert statistics.median(rounds) < 0.02, f"median round {1e3 * statistics.median(rounds):.1f} ms"


async def test_over_capacity_is_busy_at_once_never_a_hang(base):
    """2 replicas x 4 streams are held; one more connection waits at the proxy (max_queued 1) and
    is served as soon as a slot frees; the next is refused at once: 503 + busy."""
    held = [await open_peer(base) for _ in range(2 * MAX_STREAMS)]
    try:
        for i, peer in enumerate(held):
            await peer.say(f"h{i}", "waiting for more", i, end=False)
        assert sorted(p.replica for p in held).count(held[0].replica) == MAX_STREAMS  # Serve filled both
        # two more connections at once: one waits in the proxy's queue (max_queued 1), one is refused
        t0 = time.monotonic()
        attempts = {asyncio.create_task(open_peer(base)) for _ in range(2)}
        done, (queued,) = await asyncio.wait(attempts, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        (first,) = done
        with pytest.raises(InvalidStatus) as refused:
            first.result()
        refused = refused.value.response
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert json.loads(refused.body)["error"]["code"] == "busy"
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            async with http.post(f"http://{base}/v1/audio/speech", json={"input": "Hi.", "response_format": "pcm"}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == "busy"
        assert time.monotonic() - t0 < 10 and not queued.done()
        await held.pop().ws.close()
        peer = await asyncio.wait_for(queued, 20)
        async with peer.ws:
            await peer.say("q", "Hi.", 1)
            await peer.until(lambda: "q" in peer.done)
            assert peer.done["q"]["reason"] == "completed"
    finally:
        for peer in held:
            await peer.ws.close()


async def test_load_generator_through_serve(base):
    """`python -m higgs_stream.loadgen --url ws://PROXY/v1/tts/stream` measures through Serve and
    records which replica served each request. (Workers start over a ramp: with `max_queued 1`, a
    burst of simultaneous upgrades overflows the proxy's queue while it assigns them, and those
    are refused busy even with free slots; the connections opened before the start are such a
    burst, and a worker whose connection was refused opens another when it starts.)"""
    from higgs_stream.loadgen.runner import run
    from higgs_stream.loadgen.schedule import LoadConfig

    cfg = LoadConfig(url=f"ws://{base}/v1/tts/stream?token={TOKEN}", open_rates=(), closed=(4,), duration_s=2.0,
                     count=1, procs=0, warmup=0, ramp_s=1.0, request_timeout_s=30.0, drain_s=30.0)
    result = await asyncio.to_thread(run, cfg)
    (s,) = result["scenarios"]
    assert s["completed"] == s["requests"] == 4 and s["errored"] == s["busy"] == 0
    ids, _ = await asyncio.to_thread(replicas)
    assert sum(s["replicas"].values()) == 4 and set(s["replicas"]) <= ids
    assert result["server"]["status"] == "ok"  # /healthz through the proxy


async def test_killing_a_replica_mid_stream(base, reference):
    await until_replicas(2)
    by = await peers_on_both(base, per_replica=2)
    victim, survivor = sorted(by)
    expected = reference(LONG_TEXT, LONG_SEED)
    peers = by[victim] + by[survivor]
    for i, peer in enumerate(peers):
        await peer.say(f"c{i}", LONG_TEXT, LONG_SEED)
    for i, peer in enumerate(peers):
        await peer.until(lambda i=i, peer=peer: len(peer.pcm.get(f"c{i}", b"")) > 0)
    handle = ray.get_actor(f"SERVE_REPLICA::{ray_app.APP_NAME}#TTSReplica#{victim}", namespace="serve")
    killed_at = time.monotonic()
    ray.kill(handle, no_restart=True)
    for peer in by[victim]:
        await peer.until_closed(timeout=10)
        assert peer.closed_at - killed_at < 2.0, f"closed {peer.closed_at - killed_at:.2f} s after the kill"
        assert peer.close_code == 1011 and peer.errors[-1]["code"] == "internal"
    for i, peer in enumerate(by[survivor], start=len(by[victim])):
        await peer.until(lambda i=i, peer=peer: f"c{i}" in peer.done)
        assert peer.done[f"c{i}"]["reason"] == "completed" and not peer.errors
        assert_pcm_close(bytes(peer.pcm[f"c{i}"]), expected, what="the other replica's stream")
        await peer.ws.close()
    async with asyncio.timeout(10):  # Ray knows the replica is gone (the proxy did: it closed its sockets)
        while victim in (await asyncio.to_thread(replicas))[0]:
            await asyncio.sleep(0.1)
    peer = await open_peer(base)  # new requests succeed, before Serve has replaced the replica
    async with peer.ws:
        await peer.say("n", "Hello there.", 3)
        await peer.until(lambda: "n" in peer.done)
        assert_pcm_close(bytes(peer.pcm["n"]), reference("Hello there.", 3), what="after the kill")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        async with http.post(f"http://{base}/v1/audio/speech",
                             json={"input": "Hello there.", "seed": 3, "response_format": "pcm"}) as r:
            assert r.status == 200
            assert_pcm_close(await r.read(), reference("Hello there.", 3), what="http after the kill")
    await until_replicas(2, gone=victim)  # Serve replaced it


async def test_scale_down_drains_without_cutting_a_stream(base, reference, tiny_ckpt):
    await until_replicas(2)
    by = await peers_on_both(base, per_replica=2)
    peers = [p for group in by.values() for p in group]
    expected = reference(LONG_TEXT, LONG_SEED)
    for i, peer in enumerate(peers):
        await peer.say(f"d{i}", LONG_TEXT, LONG_SEED)
    for i, peer in enumerate(peers):
        await peer.until(lambda i=i, peer=peer: len(peer.pcm.get(f"d{i}", b"")) > 0)
    scaled = asyncio.create_task(asyncio.to_thread(deploy, tiny_ckpt, 1))
    for i, peer in enumerate(peers):
        await peer.until(lambda i=i, peer=peer: f"d{i}" in peer.done)
        assert peer.done[f"d{i}"]["reason"] == "completed" and not peer.errors
        assert_pcm_close(bytes(peer.pcm[f"d{i}"]), expected, what=f"stream on {peer.replica} while scaling 2 -> 1")
        await peer.ws.close()
    await asyncio.wait_for(scaled, 60)
    await until_replicas(1)
    peer = await open_peer(base)
    async with peer.ws:
        await peer.say("n", "Hello there.", 3)
        await peer.until(lambda: "n" in peer.done)
        assert peer.done["n"]["reason"] == "completed"
