"""A soak against the live server (issue #11): mixed clients (normal WebSocket and HTTP ones, their audio
checked against offline synthesis; abrupt disconnects, cancels, slow readers, contexts left open) for a
few seconds, then every stream and KV page must be back and the process's memory may not have grown past
a bound. The CI form runs ~9 s; `HIGGS_SOAK_S=300 python -m pytest -m soak tests/stream/reliability/test_soak.py`
runs the long one."""

from __future__ import annotations

import asyncio
import json
import os
import random

import aiohttp
import pytest
from higgs_stream.testing import assert_pcm_close
from higgs_stream.testing_server import Peer as WsPeer
from websockets.asyncio.client import connect
from higgs_stream.testing_server import protocol_peer as Peer
from higgs_stream.testing_server import wait_until as until


# ---------------------------------------------------------------- soak


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


PHRASES = [("Hello there.", 3), ("Hi.", 5), ("How are you?", 7)]


async def soak(host: str, state, reference, seconds: float, workers: int = 6) -> dict:
    """`workers` clients for `seconds`, each looping over behaviours: normal WebSocket and HTTP
    clients (audio checked against offline synthesis), abrupt disconnects, cancels, slow readers,
    contexts left open. Returns counts per behaviour."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds
    counts: dict[str, int] = {}
    url = f"ws://{host}/v1/tts/stream"

    def settled(peer: WsPeer, cid: str) -> bool:  # done, or refused at admission (busy: never created)
        return peer.ended(cid) or any(e.get("context_id") == cid and e["code"] == "busy" for e in peer.errors)

    async def normal_ws(rnd):
        async with connect(url) as ws:
            peer = Peer(ws)
            chosen = rnd.sample(PHRASES, 2)
            for i, (text, seed) in enumerate(chosen):
                await peer.say(f"c{i}", text, seed)
            await peer.until(lambda: settled(peer, "c0") and settled(peer, "c1"))
            assert {e["code"] for e in peer.errors} <= {"busy"}, peer.errors
            for i, (text, seed) in enumerate(chosen):
                if peer.ended(f"c{i}"):
                    (done,) = peer.dones[f"c{i}"]
                    assert done["reason"] == "completed", done
                    assert_pcm_close(bytes(peer.pcm[f"c{i}"]), reference(text, seed), what=f"soak ws {text!r}")

    async def normal_http(rnd):
        text, seed = rnd.choice(PHRASES)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://{host}/v1/audio/speech", json={"input": text, "seed": seed,
                                                                           "response_format": "pcm"}) as r:
                if r.status == 503:
                    return
                assert r.status == 200
                assert_pcm_close(await r.read(), reference(text, seed), what=f"soak http {text!r}")

    async def disconnect(rnd):
        async with connect(url) as ws:
            peer = Peer(ws)
            await peer.say("d", "A long sentence that keeps going.", 4)
            if rnd.random() < 0.5:
                await peer.until(lambda: peer.pcm.get("d") or peer.ended("d"))
            ws.transport.abort()

    async def cancel(rnd):
        async with connect(url) as ws:
            peer = Peer(ws)
            await peer.say("x", "A long sentence that keeps going.", 4, end=rnd.random() < 0.5)
            await peer.until(lambda: peer.pcm.get("x") or settled(peer, "x"))
            await ws.send(json.dumps({"type": "cancel", "context_id": "x"}))
            await peer.until(lambda: settled(peer, "x"))
            assert len(peer.dones.get("x", [])) <= 1

    async def slow_reader(rnd):
        async with connect(url, max_queue=1) as ws:
            peer = Peer(ws)
            await peer.say("s", "A long sentence that keeps going.", 4)
            async with asyncio.timeout(60):
                while not settled(peer, "s"):
                    peer.handle(await ws.recv())
                    await asyncio.sleep(0.05)  # reads far slower than the server sends

    async def left_open(rnd):
        async with connect(url) as ws:
            peer = Peer(ws)
            await peer.say("o", "Hi.", 5, end=False, flush=True)
            await peer.until(lambda: settled(peer, "o"))
            if peer.ended("o"):
                assert peer.dones["o"][0]["reason"] == "error" and peer.errors[-1]["code"] == "idle_timeout"

    behaviours = [normal_ws, normal_http, disconnect, cancel, slow_reader, left_open]

    async def worker(i):
        rnd = random.Random(i)
        while loop.time() < stop_at:
            b = behaviours[rnd.randrange(len(behaviours))]
            await b(rnd)
            counts[b.__name__] = counts.get(b.__name__, 0) + 1

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return counts


async def drained(host, state, engine) -> None:
    await until(lambda: state.pipeline.active == 0 and engine.num_active == 0
                and engine.cache.allocator.num_used == 0, timeout=30)
    async with aiohttp.ClientSession() as http, http.get(f"http://{host}/metrics") as r:
        lines = (await r.text()).splitlines()
    assert "higgs_active_streams 0" in lines and "higgs_kv_pages_used 0" in lines


async def run_soak(start_server, reference, engine, seconds: float, rss_limit: int) -> dict:
    host, state = await start_server(max_streams=16, max_contexts=4, context_idle_s=0.5)
    for text, seed in PHRASES:
        reference(text, seed)
    await soak(host, state, reference, min(3.0, seconds / 3))  # warm-up: allocator pools, caches
    await drained(host, state, engine)
    before = rss_bytes()
    counts = await soak(host, state, reference, seconds)
    await drained(host, state, engine)
    grown = rss_bytes() - before
    assert grown < rss_limit, f"RSS grew {grown / 2**20:.0f} MiB over the soak"
    assert set(counts) == {"normal_ws", "normal_http", "disconnect", "cancel", "slow_reader", "left_open"}, counts
    return counts


async def test_soak_short(start_server, reference, engine):
    """The CI form: ~9 s of mixed clients, then drained to zero streams and zero KV pages."""
    await run_soak(start_server, reference, engine, seconds=6.0, rss_limit=96 << 20)


@pytest.mark.soak
@pytest.mark.skipif("HIGGS_SOAK_S" not in os.environ, reason="opt-in: HIGGS_SOAK_S=300 python -m pytest -m soak")
async def test_soak(start_server, reference, engine):
    await run_soak(start_server, reference, engine, seconds=float(os.environ["HIGGS_SOAK_S"]), rss_limit=128 << 20)
