"""WebRTC transport: the paced track on its own, then an aiortc client peer against a live server
(tiny random checkpoint): signaling, audio over Opus, events over the data channel, cancel."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
import time

import numpy as np
import pytest

import aiohttp
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from higgs_stream.stream import serve_command, server, webrtc
from higgs_stream.engine.random_weights import suppress_eos
from higgs_stream.stream.errors import ShuttingDownError
from higgs_stream.stream.handle import StreamHandle
from higgs_stream.stream.webrtc import PacedPCMTrack, ice_configuration
from higgs_stream.testing_server import LONG_SEED, LONG_TEXT, wait_until

TEXT = "The quick brown fox jumps over the lazy dog."


# ---------------------------------------------------------------- the track alone

async def test_track_paces_on_the_wall_clock_and_fills_silence():
    fired: list[tuple[str, int]] = []
    track = PacedPCMTrack(on_marker=lambda p: fired.append((p, track.frames_sent)))
    tone = (np.arange(1200) % 100 + 1).astype("<i2").tobytes()  # 50 ms of non-zero samples
    await track.write(b"\x05\x00" * 100, tag="a")  # 100 samples
    track.mark("a-done", tag="a")
    track.mark("b-start", tag="b")
    await track.write(tone, tag="b")
    track.mark("b-done", tag="b")
    t0 = time.monotonic()
    frames = [await track.recv() for _ in range(10)]
    elapsed = time.monotonic() - t0
    assert 0.17 <= elapsed < 0.5, elapsed  # 9 waits of 20 ms (the first frame goes out at once)
    assert [f.pts for f in frames] == [480 * i for i in range(10)]
    assert all(f.samples == 480 and f.sample_rate == 24000 and f.format.name == "s16" for f in frames)
    pcm = np.concatenate([f.to_ndarray()[0] for f in frames])  # [4800]
    assert (pcm[:100] == 5).all()
    assert np.array_equal(pcm[100:1300], np.frombuffer(tone, "<i2"))
    assert (pcm[1300:] == 0).all()  # silence once the queue is empty
    # Markers fire in the frame that plays past them: a-done and b-start with frame 1, b-done with frame 3.
    assert fired == [("a-done", 0), ("b-start", 0), ("b-done", 2)]
    assert track.audio_samples_sent == 1300 and track.buffered_samples == 0


async def test_track_drop_removes_one_context_only():
    fired = []
    track = PacedPCMTrack(on_marker=fired.append)
    await track.write(b"\x01\x00" * 480, tag="a")
    track.mark("a-done", tag="a")
    track.mark("b-start", tag="b")
    await track.write(b"\x02\x00" * 960, tag="b")
    await track.write(b"\x03\x00" * 480, tag="c")
    assert track.drop("b") == ["b-start"]
    assert track.buffered_samples == 960
    pcm = np.concatenate([(await track.recv()).to_ndarray()[0] for _ in range(3)])
    assert (pcm[:480] == 1).all() and (pcm[480:960] == 3).all() and (pcm[960:] == 0).all()
    assert fired == ["a-done"]


async def test_track_write_waits_while_full():
    track = PacedPCMTrack(max_buffer_s=0.04)  # 960 samples
    await track.write(b"\x00\x00" * 960)
    blocked = asyncio.ensure_future(track.write(b"\x00\x00" * 480))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    await track.recv()  # 480 samples out: under the limit again
    await asyncio.wait_for(blocked, 1)
    assert track.buffered_samples == 960


async def test_track_write_drops_audio_no_longer_wanted():
    """A write that waited for room while its context was cancelled queues nothing: with a track of seconds (not
    minutes) the writer waits often, and the cancelled context's next chunk would play after the cancel."""
    track = PacedPCMTrack(max_buffer_s=0.04)  # 960 samples
    await track.write(b"\x01\x00" * 960, tag="a")
    cancelled = False
    blocked = asyncio.ensure_future(track.write(b"\x02\x00" * 480, tag="a", wanted=lambda: not cancelled))
    await asyncio.sleep(0)  # one turn of the loop: the write runs until it waits for room
    assert not blocked.done()
    cancelled = True
    assert track.drop("a") == [] and track.buffered_samples == 0
    await asyncio.wait_for(blocked, 1)
    assert track.buffered_samples == 0
    await track.write(b"\x03\x00" * 480, tag="b", wanted=lambda: True)  # room at once: queued
    assert track.buffered_samples == 480


# ---------------------------------------------------------------- against a live server

@pytest.fixture
async def live(tiny_ckpt):
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_ckpt), "--device", "cpu", "--max-frames", "100", "--token", "t0k",
                              "--admit-step-ratio", "0"])  # admission by load off (a loaded CI machine)
    state = serve_command.build_state(args)
    runner = await server.serve(state, "127.0.0.1", 0)
    try:
        yield _Live(state, f"http://127.0.0.1:{server.bound_port(runner)}", runner.app)
    finally:
        await runner.cleanup()


class _Live(tuple):
    """(state, base URL), and the app (its WebRTC peers: `server_peers`)."""

    def __new__(cls, state, base, app):
        live = super().__new__(cls, (state, base))
        live.app = app
        return live


def server_peers(live: _Live) -> dict:
    return live.app[webrtc.PEERS]


class Client:
    """An aiortc peer playing the browser: recvonly audio first, then a data channel."""

    def __init__(self):
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # loopback: no public STUN server
        self.pc.addTransceiver("audio", direction="recvonly")
        self.channel = self.pc.createDataChannel("tts")
        self.events: list[tuple[float, dict]] = []  # (time received, message)
        self.frames: list[tuple[float, np.ndarray]] = []  # (time received, left channel [960])
        self.opened = asyncio.Event()
        self.channel.on("open", self.opened.set)
        self.channel.on("message", lambda m: self.events.append((time.monotonic(), json.loads(m))))
        self._track = asyncio.get_running_loop().create_future()
        self.pc.on("track", self._track.set_result)
        self._reader: asyncio.Task | None = None

    async def connect(self, base: str, token: str, edit_offer=None) -> float:
        """Offer, answer, wait for the track and the channel; returns the seconds the answer took.
        `edit_offer(sdp) -> sdp` changes the offer sent (as a browser's would differ)."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        sdp = self.pc.localDescription.sdp if edit_offer is None else edit_offer(self.pc.localDescription.sdp)
        async with aiohttp.ClientSession() as http:
            t0 = time.monotonic()
            r = await http.post(f"{base}/v1/webrtc/offer", json={"sdp": sdp, "type": "offer"},
                                headers={"Authorization": f"Bearer {token}"})
            assert r.status == 200, await r.text()
            answer = await r.json()
            answer_s = time.monotonic() - t0
        assert answer["type"] == "answer" and answer["pc_id"]
        await self.pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        track = await asyncio.wait_for(self._track, 10)
        await asyncio.wait_for(self.opened.wait(), 10)
        self._reader = asyncio.ensure_future(self._read(track))
        return answer_s

    async def _read(self, track) -> None:
        while True:
            frame = await track.recv()
            assert frame.sample_rate == 48000 and frame.layout.name == "stereo"
            self.frames.append((time.monotonic(), frame.to_ndarray().reshape(-1, 2)[:, 0]))  # [960]

    def send(self, **msg) -> None:
        self.channel.send(json.dumps(msg))

    async def wait_for(self, kind: str, timeout: float = 30.0) -> tuple[float, dict]:
        async with asyncio.timeout(timeout):
            while True:
                for t, ev in self.events:
                    if ev["type"] == kind:
                        return t, ev
                await asyncio.sleep(0.01)

    def audio_between(self, t0: float, t1: float) -> np.ndarray:
        return np.concatenate([f for t, f in self.frames if t0 <= t <= t1]).astype(np.float32) / 32768

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.pc.close()


def loud_span_s(audio: np.ndarray, rate: int = 48000, threshold: float = 0.02) -> float:
    idx = np.nonzero(np.abs(audio) > threshold)[0]
    return 0.0 if idx.size == 0 else (idx[-1] - idx[0] + 1) / rate


async def test_peer_receives_the_utterance_in_real_time(live):
    _, base = live
    client = Client()
    try:
        await client.connect(base, "t0k")
        ready_t, ready = await client.wait_for("ready")
        assert ready["sample_rate"] == 24000 and ready["protocol"] == 1
        await asyncio.sleep(0.3)  # silence flows while idle
        client.send(type="text", context_id="a", text=TEXT, seed=4)
        client.send(type="end", context_id="a")
        start_t, _ = await client.wait_for("audio_start")
        done_t, done = await client.wait_for("done")
        await asyncio.sleep(0.3)  # the receive side lags playout by the jitter buffer
        assert done["reason"] == "completed" and done["context_id"] == "a"
        seconds = done["samples"] / 24000
        assert seconds > 1.0
        # done is sent when playout reaches the end: real time, not generation time.
        assert abs((done_t - start_t) - seconds) < 0.25, (done_t - start_t, seconds)
        idle = client.audio_between(ready_t, start_t - 0.1)
        assert idle.size > 0 and np.abs(idle).max() < 0.01  # the silence before it
        heard = client.audio_between(start_t - 0.1, time.monotonic())
        rms = float(np.sqrt(np.mean(heard ** 2)))
        span = loud_span_s(heard)
        print(f"webrtc: {seconds:.2f} s sent, loud span {span:.3f} s, rms {rms:.3f}, "
              f"audio_start->done {done_t - start_t:.3f} s")
        assert rms > 0.05, rms
        assert abs(span - seconds) < 0.06, (span, seconds)
    finally:
        await client.close()


async def test_cancel_silences_the_track_at_once(live):
    state, base = live
    client = Client()
    try:
        await client.connect(base, "t0k")
        client.send(type="text", context_id="long", text=TEXT, seed=4)
        client.send(type="end", context_id="long")
        start_t, _ = await client.wait_for("audio_start")
        await asyncio.sleep(0.5)
        cancel_t = time.monotonic()
        client.send(type="cancel", context_id="long")
        done_t, done = await client.wait_for("done")
        # Cancelled although generation may have finished already: the rest was never played.
        assert done["reason"] == "cancelled" and done_t - cancel_t < 0.5
        assert 0.3 * 24000 < done["samples"] < 24000 * 4 * 0.5  # what was heard (~0.5 s)
        await asyncio.sleep(0.5)
        after = client.audio_between(cancel_t + 0.25, time.monotonic())
        assert after.size > 0 and np.abs(after).max() < 0.01, np.abs(after).max()
        assert loud_span_s(client.audio_between(start_t - 0.1, cancel_t + 0.25)) > 0.3
        # The session goes on: the next context plays.
        client.send(type="text", context_id="next", text="Hello there.", seed=1, flush=True)
        client.send(type="end", context_id="next")
        _, done2 = await asyncio.wait_for(_done_of(client, "next"), 30)
        assert done2["reason"] == "completed" and done2["samples"] > 0
    finally:
        await client.close()
    async with asyncio.timeout(5):  # the peer's session ended: its streams are released
        while state.pipeline.active:
            await asyncio.sleep(0.02)


async def _done_of(client: Client, cid: str) -> tuple[float, dict]:
    while True:
        for t, ev in client.events:
            if ev["type"] == "done" and ev["context_id"] == cid:
                return t, ev
        await asyncio.sleep(0.01)


async def test_offer_errors(live):
    _, base = live
    async with aiohttp.ClientSession() as http:
        r = await http.post(f"{base}/v1/webrtc/offer", json={"sdp": "v=0", "type": "offer"})
        assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
        r = await http.post(f"{base}/v1/webrtc/offer?token=t0k", data=b"not json")  # not application/json
        assert r.status == 415 and (await r.json())["error"]["code"] == "unsupported_media_type"
        r = await http.post(f"{base}/v1/webrtc/offer?token=t0k", data=b"not json",
                            headers={"Content-Type": "application/json"})
        assert r.status == 400 and (await r.json())["error"]["code"] == "bad_json"
        r = await http.post(f"{base}/v1/webrtc/offer?token=t0k", json={"sdp": "v=0", "type": "answer"})
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_input"
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))  # data channel only: no audio to answer with
        pc.createDataChannel("tts")
        await pc.setLocalDescription(await pc.createOffer())
        r = await http.post(f"{base}/v1/webrtc/offer?token=t0k",
                            json={"sdp": pc.localDescription.sdp, "type": "offer"})
        await pc.close()
        assert r.status == 400 and "audio" in (await r.json())["error"]["message"]


AUDIO = "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n"
ICE = ("a=ice-ufrag:aaaa\r\na=ice-pwd:bbbbbbbbbbbbbbbbbbbbbbbb\r\na=fingerprint:sha-256 AA\r\n"
       "a=setup:actpass\r\na=mid:0\r\na=rtcp-mux\r\n")
# What aiortc's SDP parser raises on each (found by fuzzing the offer route).
GARBAGE_SDP = [
    ("m=audio", "AssertionError"),
    (AUDIO + "a=rtpmap:111\r\n", "ValueError"),
    (AUDIO + ICE + "a=rtpmap:111 opus\r\n", "IndexError"),
    (AUDIO + ICE.replace("actpass", "bogus"), "KeyError"),
    (AUDIO + ICE.replace("a=setup:actpass\r\n", "") + "a=rtpmap:111 opus/48000/2\r\n", "AttributeError"),
    ("v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 0\r\n" + ICE, "OperationError"),
]


async def test_garbage_offers_get_typed_errors_and_close_their_peer(live, monkeypatch):
    """Each shape was a 500 with a traceback, and the peer connection made for it stayed open."""
    state, base = live
    made: list[tuple[RTCPeerConnection, RTCConfiguration]] = []

    class Recording(RTCPeerConnection):
        def __init__(self, configuration=None):
            super().__init__(configuration)
            made.append((self, configuration))

    monkeypatch.setattr(webrtc, "RTCPeerConnection", Recording)
    url = f"{base}/v1/webrtc/offer?token=t0k"
    async with aiohttp.ClientSession() as http:
        for sdp, raised in GARBAGE_SDP:
            async with http.post(url, json={"sdp": sdp, "type": "offer"}) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["code"] == "invalid_input" and raised in err["message"], err
        for body, status, code in [
            (b"[" * 1000 + b"]" * 1000, 400, "bad_json"),  # RecursionError in the offer parser
            (b'{"sdp": "v=0\\ud800", "type": "offer"}', 400, "invalid_input"),
        ]:
            async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == status and (await r.json())["error"]["code"] == code
        async with http.post(url, json={"sdp": "v=0", "type": "offer"}, headers={"Origin": "https://evil.example"}) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "forbidden_origin"
    assert len(made) == len(GARBAGE_SDP)
    assert all(pc.connectionState == "closed" and pc.signalingState == "closed" for pc, _ in made)
    assert all(cfg.iceServers == [] for _, cfg in made)  # no public STUN server unless configured
    client = Client()  # and the route still works
    try:
        await client.connect(base, "t0k")
    finally:
        await client.close()


MDNS = "a=candidate:3 1 udp 2122260223 0b7a54c2-2c4e-4c1c-9d3b-6f1f5e0a7d21.local 54321 typ host\r\n"


def _with_mdns_candidate(sdp: str) -> str:
    """A Chromium-style offer: an mDNS host candidate before the first real one."""
    i = sdp.index("a=candidate:")
    return sdp[:i] + MDNS + sdp[i:]


def test_drop_mdns_candidates_keeps_every_other_line():
    offer = ("v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\n" + MDNS
             + "a=candidate:1 1 udp 2122260223 192.168.1.7 50000 typ host\r\n"
             + "a=candidate:2 1 udp 1686052607 203.0.113.5 50001 typ srflx raddr 0.0.0.0 rport 0\r\n"
             + "a=candidate:4 1 udp 2122260223 HOST.LOCAL. 50002 typ host\r\n"
             + "a=end-of-candidates\r\n")
    sdp, dropped = webrtc.drop_mdns_candidates(offer)
    assert dropped == 2
    assert sdp == offer.replace(MDNS, "").replace("a=candidate:4 1 udp 2122260223 HOST.LOCAL. 50002 typ host\r\n", "")
    assert webrtc.drop_mdns_candidates(sdp) == (sdp, 0)


async def test_offer_with_an_mdns_candidate_is_answered_at_once(live):
    """aioice would try to resolve the `.local` name for 1 s before answering; dropped, the
    answer comes in well under that, and the peer still connects through its real candidates."""
    _, base = live
    client = Client()
    try:
        answer_s = await client.connect(base, "t0k", edit_offer=_with_mdns_candidate)
        assert answer_s < 0.5, answer_s
    finally:
        await client.close()


def test_ice_servers_come_from_the_config():
    assert ice_configuration(()).iceServers == []  # aiortc's None would mean stun.l.google.com
    cfg = ice_configuration(("stun:stun.example.com:3478", "turn:alice:s3cret@turn.example.com?transport=tcp"))
    stun, turn = cfg.iceServers
    assert stun.urls == "stun:stun.example.com:3478" and stun.username is None
    assert (turn.urls, turn.username, turn.credential) == ("turn:turn.example.com?transport=tcp", "alice", "s3cret")


async def _post_offer(http, base: str, sdp: str):
    async with http.post(f"{base}/v1/webrtc/offer?token=t0k", json={"sdp": sdp, "type": "offer"}) as r:
        return r.status, await r.json()


async def test_offer_with_too_many_candidates_is_too_large(live):
    """65 ICE candidates: 413 before any peer connection is made (15,000 of them held the event loop for 19 s and
    every stream's audio with it, found by a probe); the route goes on."""
    state, base = live
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    i = sdp.index("a=candidate:")
    many = "".join(f"a=candidate:{n} 1 udp 2122260223 10.0.{n // 250}.{n % 250 + 1} {40000 + n} typ host\r\n"
                   for n in range(webrtc.MAX_OFFER_CANDIDATES + 1))
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await _post_offer(http, base, sdp[:i] + many + sdp[i:])
            assert status == 413 and body["error"]["code"] == "too_large" and "ICE candidates" in body["error"]["message"]
            status, body = await _post_offer(http, base, sdp)  # a browser's handful
            assert status == 200 and body["type"] == "answer"
    finally:
        await pc.close()


async def test_concurrent_offers_keep_the_peer_limit(live, monkeypatch):
    """Six offers at once against a limit of 2 peers: 2 answered, 4 refused busy (each peer is counted before the
    offer's first await; 300 at once all passed the check before)."""
    state, base = live
    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, max_streams=2))
    pcs = [RTCPeerConnection(RTCConfiguration(iceServers=[])) for _ in range(6)]
    try:
        for pc in pcs:
            pc.addTransceiver("audio", direction="recvonly")
            await pc.setLocalDescription(await pc.createOffer())
        async with aiohttp.ClientSession() as http:
            results = await asyncio.gather(*(_post_offer(http, base, pc.localDescription.sdp) for pc in pcs))
        assert sorted(status for status, _ in results) == [200, 200, 503, 503, 503, 503]
        assert {body["error"]["code"] for status, body in results if status == 503} == {"busy"}
    finally:
        for pc in pcs:
            await pc.close()


async def test_a_peer_that_opens_no_data_channel_is_closed(live, monkeypatch):
    """Connected, but no data channel (so no session and no idle clock): closed after CONNECT_TIMEOUT_S (it stayed
    open, streaming silence and holding a peer slot, found by a probe)."""
    state, base = live
    monkeypatch.setattr(webrtc, "CONNECT_TIMEOUT_S", 1.0)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    try:
        await pc.setLocalDescription(await pc.createOffer())
        async with aiohttp.ClientSession() as http:
            status, answer = await _post_offer(http, base, pc.localDescription.sdp)
        assert status == 200
        await pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], answer["type"]))
        peers = server_peers(live)
        peer = peers[answer["pc_id"]]
        await wait_until(lambda: peer.connected.is_set(), 10)
        await wait_until(lambda: answer["pc_id"] not in peers, 10)
        assert peer.closed.is_set() and not peer.attached.is_set()
    finally:
        await pc.close()


async def test_a_cors_origin_may_post_an_offer(live, monkeypatch):
    """PROTOCOL.md §0: a `--cors-origin` page may post an offer: its preflight is answered and the answer carries
    Access-Control-Allow-Origin (the preflight was a 405 and the answer unreadable, found by a probe)."""
    state, base = live
    page = "https://app.example"
    monkeypatch.setattr(state, "config", dataclasses.replace(state.config, cors_origins=(page,)))
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    try:
        await pc.setLocalDescription(await pc.createOffer())
        async with aiohttp.ClientSession() as http:
            async with http.options(f"{base}/v1/webrtc/offer", headers={
                    "Origin": page, "Access-Control-Request-Method": "POST"}) as r:
                assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == page
                assert r.headers["Access-Control-Allow-Methods"] == "POST, OPTIONS"
            async with http.post(f"{base}/v1/webrtc/offer?token=t0k", json={"sdp": pc.localDescription.sdp,
                                 "type": "offer"}, headers={"Origin": page}) as r:
                assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == page
            async with http.options(f"{base}/v1/webrtc/offer", headers={"Origin": "https://evil.example"}) as r:
                assert r.status == 403
    finally:
        await pc.close()


@pytest.mark.parametrize("edit", [lambda sdp: sdp.replace("a=recvonly", "a=sendonly"),
                                  lambda sdp: sdp.replace("a=recvonly", "a=inactive"),
                                  lambda sdp: re.sub(r"^m=audio \d+ ", "m=audio 0 ", sdp, count=1, flags=re.M)],
                         ids=["sendonly", "inactive", "rejected"])
async def test_an_offer_that_would_not_receive_audio_is_refused(live, edit):
    """An offer whose audio the peer would not receive (sendonly, inactive, port 0) is invalid_input: it was answered,
    and its contexts generated speech for a track nobody played (found by a probe). The route goes on."""
    state, base = live
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio", direction="recvonly")
    pc.createDataChannel("tts")
    try:
        await pc.setLocalDescription(await pc.createOffer())
        sdp = edit(pc.localDescription.sdp)
        assert sdp != pc.localDescription.sdp
        async with aiohttp.ClientSession() as http:
            status, body = await _post_offer(http, base, sdp)
        assert status == 400 and body["error"]["code"] == "invalid_input", body
        assert "recvonly or sendrecv" in body["error"]["message"]
        assert server_peers(live) == {}
    finally:
        await pc.close()
    client = Client()
    try:
        await client.connect(base, "t0k")
    finally:
        await client.close()


async def test_a_real_time_peer_pauses_its_context_ahead_of_playout(live, monkeypatch):
    """Back-pressure over WebRTC: the track queues TRACK_BUFFER_S ahead of playout, then the context's own queue fills
    and the context is held (`StreamHandle._hold`), resumed as playout drains it. It still plays in real time to a
    completed done with every sample generated (with a 600 s track a long text's whole audio was generated at once,
    and back-pressure never engaged). 0.3 s each here; 5 s and 10 s served. Whether its engine stream is paused too
    depends on the race between the hold and the end of its 100 frames on this CPU (CI's engine thread once finished
    first): tests/stream/test_pipeline.py pauses a held stream's engine stream where the hold lasts."""
    state, base = live
    monkeypatch.setattr(webrtc, "TRACK_BUFFER_S", 0.3)
    monkeypatch.setattr(state.pipeline, "cfg", dataclasses.replace(state.pipeline.cfg, stream_hold_s=0.3))
    pipeline = state.pipeline
    holds = []  # latched: (on, samples generated) at each hold (a hold resumes once half of it has played)
    hold = StreamHandle._hold
    monkeypatch.setattr(StreamHandle, "_hold", lambda handle, on: (holds.append((on, handle.samples)),
                                                                    hold(handle, on))[-1])
    client = Client()
    try:
        await client.connect(base, "t0k")
        client.send(type="text", context_id="a", text=LONG_TEXT, seed=LONG_SEED)  # 4 s (the 100-frame cap)
        client.send(type="end", context_id="a")
        await wait_until(lambda: pipeline._handles, 30)
        (handle,) = pipeline._handles
        await wait_until(lambda: any(on for on, _ in holds), 30)
        assert next(n for on, n in holds if on) <= 3 * 24000  # held with at least a second of its audio to come
        start_t, _ = await client.wait_for("audio_start")
        done_t, done = await client.wait_for("done")
        assert done["reason"] == "completed" and handle.finished and not handle.held
        assert done["samples"] == handle.samples == 100 * 960  # every generated sample played
        seconds = done["samples"] / 24000
        assert abs((done_t - start_t) - seconds) < 0.25, (done_t - start_t, seconds)
        assert pipeline.metrics.slow_clients.value() == 0
    finally:
        await client.close()


# ---------------------------------------------------------------- outcomes: counted when the track plays them

def _count(state, outcome: str) -> float:
    return state.metrics.requests.value(transport="webrtc", outcome=outcome)


def _playing_out(state, cid: str) -> bool:
    """The server's session took the context's completed End; its done waits in the track behind its audio."""
    return any(cid in getattr(r, "playing_out", {}) for r in list(state.sessions))


async def _completed_in_the_track(live, cid: str) -> Client:
    """A peer whose context (4 s: end of speech suppressed, --max-frames 100) finished generating, its audio and done
    still queued in the track (5 s ahead of playout): nothing counted yet (a probe: `completed` 5 s early)."""
    state, base = live
    suppress_eos(state.pipeline.engine)
    client = Client()
    await client.connect(base, "t0k")
    client.send(type="text", context_id=cid, text=TEXT, seed=4)
    client.send(type="end", context_id=cid)
    await wait_until(lambda: _playing_out(state, cid), 30)
    assert not [ev for _, ev in client.events if ev["type"] == "done"]
    assert _count(state, "completed") == 0
    return client


async def test_a_completed_context_is_counted_when_its_done_plays(live):
    state, _ = live
    client = await _completed_in_the_track(live, "a")
    try:
        _, done = await client.wait_for("done")
        assert done["reason"] == "completed" and done["samples"] == 100 * 960
        await wait_until(lambda: _count(state, "completed") == 1)
        assert not _playing_out(state, "a")
    finally:
        await client.close()


async def test_a_peer_gone_before_its_done_played_is_disconnected(live):
    state, _ = live
    client = await _completed_in_the_track(live, "a")
    await client.close()
    await wait_until(lambda: _count(state, "disconnected") == 1)
    assert _count(state, "completed") == 0 and state.pipeline.active == 0


async def test_a_cancel_during_playout_is_counted_cancelled(live):
    state, _ = live
    client = await _completed_in_the_track(live, "a")
    try:
        client.send(type="cancel", context_id="a")
        _, done = await client.wait_for("done")
        assert done["reason"] == "cancelled" and done["samples"] < 100 * 960
        await wait_until(lambda: _count(state, "cancelled") == 1)
        assert _count(state, "completed") == 0
    finally:
        await client.close()


async def test_an_error_during_playout_sends_its_done_at_once(live):
    """The drain's end (`end_all`) while a peer's track holds seconds of a context's audio: error, then done at once
    (a probe: done waited behind the audio and was dropped when the peers closed)."""
    state, base = live
    suppress_eos(state.pipeline.engine)
    client = Client()
    try:
        await client.connect(base, "t0k")
        for i in range(3):  # 3 x 4 s: more than the track holds, so the context is still open
            client.send(type="text", context_id="a", text=TEXT, seed=4, flush=True)
        client.send(type="end", context_id="a")
        await client.wait_for("audio_start")
        await wait_until(lambda: state.pipeline.active == 1 and any(
            r.handles.get("a") is not None and r.handles["a"].samples > 6 * 24000 for r in list(state.sessions)), 30)
        state.pipeline.end_all(ShuttingDownError("the server is shutting down"))
        error_t, error = await client.wait_for("error", 10)
        done_t, done = await client.wait_for("done", 10)
        assert error["code"] == "shutting_down" and done["reason"] == "error"
        assert done_t - error_t < 1.0 and done["samples"] < 6 * 24000
        await wait_until(lambda: _count(state, "error") == 1)
        assert _count(state, "completed") == 0
    finally:
        await client.close()
