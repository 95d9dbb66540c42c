"""A client that stops reading (stream/server_state.py `limit_send_buffer`, `ServerConfig.send_buffer_kib`): its
context's generation pauses after the hold plus what the kernel buffers can take, a few seconds of audio on either
transport (with the kernel's autotuning a loopback client that read nothing had ~85 s generated, 4 MiB waiting in
the server's send queue: measured while building this); when it reads again it gets every sample, then `done`."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest
from higgs_stream.testing_server import Peer, wait_until
from websockets.asyncio.client import connect

SENTENCES = 40  # 30 frames (1.2 s) each at most: up to 48 s of audio
HOLD_S = 2.0
BUFFER_KIB = 16  # Linux doubles it: 32 KiB, 0.7 s of 24 kHz s16 audio
CLIENT_RCVBUF = 16 * 1024


def _small_client_socket(port: int) -> socket.socket:
    """The client's own receive buffer kept small too (the kernel's default lets a loopback peer take ~340 KB)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    sock.connect(("127.0.0.1", port))
    return sock


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="kernel buffer sizes as Linux keeps them")
async def test_a_client_that_stops_reading_is_held_after_a_few_seconds_of_audio(start_server):
    addr, state = await start_server(stream_hold_s=HOLD_S, send_buffer_kib=BUFFER_KIB)
    port = int(addr.rsplit(":", 1)[1])
    text = " ".join(f"Sentence number {i} is about the weather today." for i in range(SENTENCES))
    async with connect(f"ws://{addr}/v1/tts/stream", sock=_small_client_socket(port), compression=None,
                       max_size=None, max_queue=1) as ws:  # the client library reads ahead one message at most
        await ws.send(json.dumps({"type": "text", "context_id": "c", "text": text, "seed": 3}))
        await ws.send(json.dumps({"type": "end", "context_id": "c"}))
        await wait_until(lambda: any(h.held for h in state.pipeline._handles), timeout=120)
        made_s = state.metrics.audio_seconds.value()
        # the hold, the server's send queue (2 x 16 KiB), the client's receive buffer, one merged frame (1 s) each
        # side of the socket and what the steps in flight finish: a bound, not the measured ~3-4 s
        assert HOLD_S <= made_s <= HOLD_S + 8.0, made_s
        peer = Peer(ws)
        await peer.until(lambda: peer.ended("c"), timeout=120)
    assert peer.done["c"]["reason"] == "completed"
    got_s = len(peer.pcm["c"]) / 2 / 24000
    assert got_s == pytest.approx(state.metrics.audio_seconds.value(), abs=1e-3) and got_s > made_s + 1.0


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="kernel buffer sizes as Linux keeps them")
async def test_a_download_left_after_its_generation_ended_is_disconnected(start_server):
    """An HTTP client that takes a little, stops reading until the stream's generation has ended, then resets the
    connection: counted `disconnected` (its audio never left), on both transports (uvicorn's send returns at once
    once its client has gone: the ASGI producer ran the stream to its end, counted completed; a probe)."""
    addr, state = await start_server(send_buffer_kib=4, max_frames=120)  # up to 5 x 4.8 s: far more than the buffers
    sock = _small_client_socket(int(addr.rsplit(":", 1)[1]))
    text = " ".join(f"Sentence {i} of a download that is left." for i in range(5))
    body = json.dumps({"input": text, "response_format": "pcm", "seed": 2})
    sock.sendall(f"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    sock.setblocking(False)
    got, loop = b"", asyncio.get_running_loop()
    while len(got) < 2000:  # the headers and the first audio
        got += await loop.sock_recv(sock, 4096)
    await wait_until(lambda: state.pipeline.active == 0 and state.metrics.engine_streams.value() == 0, timeout=60)
    assert state.metrics.requests.value(transport="http", outcome="completed") == 0  # its End not taken yet
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
    sock.close()
    await wait_until(lambda: state.metrics.requests.value(transport="http", outcome="disconnected") == 1, timeout=30)
    assert state.metrics.requests.value(transport="http", outcome="completed") == 0
