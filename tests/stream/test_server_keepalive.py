"""The aiohttp WebSocket's keepalive (stream/server.py `AiohttpSocket`, `tcp_acked`) on fake and real sockets: a peer
whose TCP acknowledges what it is sent is alive whatever its pongs; one that neither reads nor answers is aborted.
The live server's tests (client pings answered among them): test_server.py."""

from __future__ import annotations

import asyncio

import pytest

from higgs_stream.stream import server as server_mod
from higgs_stream.testing_server import wait_until


class _FakeSock:
    """A socket whose TCP acknowledges `step` more bytes at every look (0: the peer stopped reading)."""

    def __init__(self, step: int):
        self.step, self.acked, self.looks = step, 0, 0

    def getsockopt(self, level, option, size):
        self.looks += 1
        self.acked += self.step
        return bytes(server_mod.TCP_INFO_BYTES_ACKED) + self.acked.to_bytes(8, "little") + bytes(size - 128)


class _FakeTransport:
    def __init__(self, sock):
        self.sock, self.aborted = sock, False

    def get_extra_info(self, name):
        return self.sock if name == "socket" else None

    def abort(self):
        self.aborted = True


class _FakeWs:
    """A WebSocket whose peer sends nothing (receive waits) and never answers a ping."""

    closed = False

    def __init__(self):
        self.pings = 0

    async def receive(self):
        await asyncio.Event().wait()

    async def ping(self):
        self.pings += 1

    async def close(self, code, message):
        self.closed = True


@pytest.mark.skipif(not hasattr(__import__("socket"), "TCP_INFO"), reason="TCP_INFO: Linux")
@pytest.mark.parametrize("step", [0, 1000])
async def test_keepalive_aborts_a_peer_that_neither_reads_nor_answers(step):
    """Beat 0.08 s: a peer whose TCP acknowledges nothing new and who sends nothing gets a ping after one beat and is
    aborted after 1.5; one whose TCP keeps acknowledging (it reads audio as it plays, its pong queued behind it) is
    never pinged nor aborted. Counted in the keepalive's own looks (a quarter beat each), not in sleeps."""
    ws, sock = _FakeWs(), _FakeSock(step)
    transport = _FakeTransport(sock)
    conn = server_mod.AiohttpSocket(ws, heartbeat_s=0.08, transport=transport)
    reader = asyncio.create_task(conn.receive())
    try:
        async with asyncio.timeout(10):
            while sock.looks < 12 and not transport.aborted:  # 12 looks = 3 beats
                await asyncio.sleep(0.01)
        assert transport.aborted == (step == 0) and (ws.pings >= 1) == (step == 0)
        if step == 0:
            assert 5 <= sock.looks <= 8  # aborted at 1.5 beats (6 looks; the first look sees its first count)
    finally:
        reader.cancel()
        await conn.close()


async def test_tcp_acked_counts_what_the_peer_read():
    """tcp_acked on a real loopback connection: it grows by what the peer read (None off Linux)."""
    got = asyncio.Queue()

    async def serve_one(reader, writer):
        await got.put(writer)

    server = await asyncio.start_server(serve_one, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, client = await asyncio.open_connection("127.0.0.1", port)
    writer = await got.get()
    try:
        before = server_mod.tcp_acked(writer.transport)
        if before is None:
            pytest.skip("no TCP_INFO here")
        writer.write(b"x" * 50_000)
        await writer.drain()
        assert len(await reader.readexactly(50_000)) == 50_000
        await wait_until(lambda: server_mod.tcp_acked(writer.transport) >= before + 50_000, 5)
    finally:
        for w in (writer, client):
            w.close()
        server.close()
        await server.wait_closed()
