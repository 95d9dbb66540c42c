"""WebRTC transport: `POST /v1/webrtc/offer` signaling, an audio track paced on the wall clock, and
the protocol of PROTOCOL.md §1 over a data channel.

The browser (or any peer) offers a receive-only audio transceiver first and a data channel; the
server answers with one `PacedPCMTrack`. Text messages (`text`, `end`, `cancel`, ...) go over the
data channel and are run by the same `SessionRunner` as the WebSocket; the PCM goes into the track
instead of binary messages. The track plays 20 ms frames at the wall-clock rate and sends silence
when idle, so the RTP clock never stops. `audio_start` and `done` of the playing context travel as
track markers: they reach the peer when playout reaches them, in step with what it hears. A
client `cancel` drops the context's queued audio from the track at once.

Differences from the WebSocket (what the listener hears is what counts here):
- `done.samples` is the number of samples played out;
- a `cancel` that arrives after generation finished but before playout did still ends the context
  with `done{reason:"cancelled"}` (on the WebSocket it would be ignored: `done` was already sent);
- `audio:"base64"` changes nothing: audio always goes to the track, never to the data channel.
"""

from __future__ import annotations

import asyncio
import base64
import fractions
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import web
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.sdp import SessionDescription
from av import AudioFrame
from higgs_stream.engine.errors import (
    CapacityError,
    HiggsStreamError,
    InvalidInputError,
)
from higgs_stream.stream.config import ICE_SERVER, SAMPLE_RATE
from higgs_stream.stream.driver import SessionRunner
from higgs_stream.stream.errors import TooLargeError
from higgs_stream.stream.guards import check_request, read_body
from higgs_stream.stream.messages import check_unicode, parse_json
from higgs_stream.stream.server import error_response, request_view
from higgs_stream.stream.server_state import STATE, ServerState

log = logging.getLogger(__name__)

SAMPLE_WIDTH = 2  # bytes per s16 sample
CONNECT_TIMEOUT_S = 30.0  # a peer that has not connected by then, or opened no data channel by then after, is closed
# ICE candidates an offer may carry (a browser sends a few per interface): aioice adds each with a scan of those it
# holds, on the event loop, so 15,000 of them (a 1.8 MB offer) stopped every stream's audio for 19 s (a probe)
MAX_OFFER_CANDIDATES = 64
# audio the track queues ahead of playout: past it the session's writer waits, so the context's own queue fills and
# its generation pauses at ServerConfig.stream_hold_s (back-pressure, as for a WebSocket listener that reads as it
# plays): a peer is at most this + stream_hold_s ahead of what it has heard. (600 s before: a long text's whole audio
# was generated at once, the GPU's work for a listener minutes away from hearing it)
TRACK_BUFFER_S = 5.0


# ---------------------------------------------------------------- the track

@dataclass
class _Item:
    tag: Any  # which context the item belongs to (for `drop`)
    pcm: bytes | None = None  # s16le mono; None for a marker
    payload: Any = None  # marker payload
    offset: int = 0  # bytes of `pcm` already sent


class PacedPCMTrack(MediaStreamTrack):
    """An audio track fed with s16le mono PCM; `recv()` paces `ptime` frames on the wall clock.

    `write(pcm, tag)` queues audio (waiting while more than `max_buffer_s` is queued),
    `mark(payload, tag)` queues a marker handed to `on_marker` when playout passes it,
    `drop(tag)` removes a context's queued audio and markers (barge-in), `clear()` everything.
    """

    kind = "audio"

    def __init__(self, sample_rate: int = SAMPLE_RATE, ptime: float = 0.020, max_buffer_s: float = 10.0,
                 on_marker: Callable[[Any], None] | None = None, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        assert sample_rate > 0 and ptime > 0, f"bad sample_rate {sample_rate} / ptime {ptime}"
        self.sample_rate = sample_rate
        self.frame_samples = round(sample_rate * ptime)
        assert self.frame_samples > 0, "ptime too small for the sample rate"
        self.max_buffer_samples = round(max_buffer_s * sample_rate)
        self.on_marker = on_marker
        self._clock = clock
        self._time_base = fractions.Fraction(1, sample_rate)
        self._queue: deque[_Item] = deque()
        self._buffered = 0  # samples queued, not yet sent
        self._space = asyncio.Event()  # set while under max_buffer_samples
        self._space.set()
        self._start: float | None = None
        self._pts = 0  # samples sent (audio + silence): the RTP clock
        self._sent_by_tag: dict[Any, int] = {}  # audio samples sent per tag (until `forget`)
        self.frames_sent = 0
        self.audio_samples_sent = 0  # samples that came from the queue (not silence)

    @property
    def buffered_samples(self) -> int:
        return self._buffered

    async def write(self, pcm: bytes, tag: Any = None, wanted: Callable[[], bool] | None = None) -> None:
        """Queue s16le mono PCM (a whole number of samples); waits while the queue is full. `wanted`: asked once
        the queue has room; False drops `pcm` (its context was cancelled while this write waited)."""
        assert len(pcm) % SAMPLE_WIDTH == 0, f"odd PCM byte count {len(pcm)}"
        while self._buffered >= self.max_buffer_samples and self.readyState == "live":
            self._space.clear()
            await self._space.wait()
        if self.readyState != "live":
            raise MediaStreamError("track ended")
        if pcm and (wanted is None or wanted()):
            self._queue.append(_Item(tag, pcm=bytes(pcm)))
            self._buffered += len(pcm) // SAMPLE_WIDTH

    def mark(self, payload: Any, tag: Any = None) -> None:
        """Hand `payload` to `on_marker` once every sample queued before it has been sent."""
        self._queue.append(_Item(tag, payload=payload))

    def drop(self, tag: Any) -> list[Any]:
        """Remove the queued audio and markers of `tag`; returns the dropped markers' payloads."""
        kept: deque[_Item] = deque()
        dropped = []
        for item in self._queue:
            if item.tag != tag:
                kept.append(item)
            elif item.pcm is None:
                dropped.append(item.payload)
            else:
                self._buffered -= (len(item.pcm) - item.offset) // SAMPLE_WIDTH
        self._queue = kept
        self._wake_writer()
        return dropped

    def forget(self, tag: Any) -> int:
        """Audio samples of `tag` sent so far; stops counting for it."""
        return self._sent_by_tag.pop(tag, 0)

    def clear(self) -> list[Any]:
        dropped = [item.payload for item in self._queue if item.pcm is None]
        self._queue.clear()
        self._buffered = 0
        self._wake_writer()
        return dropped

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError("track ended")
        now = self._clock()
        if self._start is None:
            self._start = now
        else:  # frame k goes out at start + k * ptime; a late frame goes out at once (catch-up)
            due = self._start + self._pts / self.sample_rate
            if due > now:
                await asyncio.sleep(due - now)
        samples = np.zeros(self.frame_samples, dtype=np.int16)  # [n] silence unless audio is queued
        filled = self._fill(samples)
        frame = AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")  # [1, n]
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        frame.time_base = self._time_base
        self._pts += self.frame_samples
        self.frames_sent += 1
        self.audio_samples_sent += filled
        return frame

    def _fill(self, out: np.ndarray) -> int:
        """Copy queued audio into `out`, firing markers as playout passes them; returns samples used."""
        pos = 0
        while self._queue:
            item = self._queue[0]
            if item.pcm is None:
                self._queue.popleft()
                if self.on_marker is not None:
                    self.on_marker(item.payload)
                continue
            if pos == len(out):
                break
            n = min(len(out) - pos, (len(item.pcm) - item.offset) // SAMPLE_WIDTH)
            out[pos:pos + n] = np.frombuffer(item.pcm, dtype="<i2", count=n, offset=item.offset)
            item.offset += n * SAMPLE_WIDTH
            pos += n
            self._sent_by_tag[item.tag] = self._sent_by_tag.get(item.tag, 0) + n
            if item.offset == len(item.pcm):
                self._queue.popleft()
        self._buffered -= pos
        if pos:
            self._wake_writer()
        return pos

    def _wake_writer(self) -> None:
        if self._buffered < self.max_buffer_samples:
            self._space.set()

    def stop(self) -> None:
        self.clear()
        super().stop()
        self._space.set()  # a blocked writer sees the ended track


# ---------------------------------------------------------------- one peer connection

class WebRTCPeer:
    """One peer connection: its track, its data channel and the session running over them."""

    def __init__(self, state: ServerState, pc: RTCPeerConnection):
        self.id = uuid.uuid4().hex
        self.state = state
        self.pc = pc
        self.track = PacedPCMTrack(max_buffer_s=TRACK_BUFFER_S, on_marker=self._send_marker)
        self.channel: RTCDataChannel | None = None
        self.connected = asyncio.Event()
        self.attached = asyncio.Event()  # its data channel opened: the session runs
        self.closed = asyncio.Event()
        self._inbox: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self._playing: str | None = None  # the context whose audio the session is writing
        self._playing_cancelled = False  # the client cancelled it; its done has not come yet
        self._task: asyncio.Task | None = None
        self._runner: SessionRunner | None = None  # its session: told when a completed context's done plays
        self.watcher: asyncio.Task | None = None

    def attach(self, channel: RTCDataChannel) -> None:
        """The peer's data channel: the session runs over the first one opened."""
        if self.channel is not None:
            log.info("peer %s opened a second data channel %r; closing it", self.id, channel.label)
            channel.close()
            return
        self.channel = channel
        self.attached.set()
        channel.on("message", self._inbox.put_nowait)
        channel.on("close", lambda: self._inbox.put_nowait(None))
        self._task = asyncio.create_task(self._run(), name=f"webrtc-session-{self.id}")

    async def _run(self) -> None:
        try:
            self._runner = SessionRunner(self.state, self._send_text, self._send_bytes, transport="webrtc",
                                         plays_out=True)
            await self._runner.run(self._receive)
        except Exception:  # its contexts got error{internal} + done; the peer connection closes
            log.exception("webrtc session of peer %s failed", self.id)
        finally:
            self._runner = None
            await self.close()

    async def _receive(self) -> str | bytes | None:
        message = await self._inbox.get()
        if isinstance(message, str):
            self._intercept_cancel(message)
        return message

    def _intercept_cancel(self, raw: str) -> None:
        """A client `cancel` silences the context at once (the session then ends it as usual)."""
        try:
            msg = parse_json(raw, self.state.config.max_message_bytes)
        except HiggsStreamError:
            return  # the session answers it
        if not isinstance(msg, dict) or msg.get("type") != "cancel" or not isinstance(msg.get("context_id"), str):
            return
        cid = msg["context_id"]
        if cid == self._playing:
            self._playing_cancelled = True  # drop the rest of its audio; its done goes out at once
        for payload in self.track.drop(cid):
            # Generation had finished but playout had not: the listener's context ends here, so
            # the queued done goes now, as a cancel. An unplayed audio_start is never sent.
            if json.loads(payload).get("type") == "done":
                if self._runner is not None:
                    self._runner.unplayed(cid, "cancelled")
                self._send_now(self._played_done(cid, "cancelled"))

    def _played_done(self, cid: str, reason: str) -> str:
        """`done` counting the samples that were played out (over WebRTC, `samples` = heard)."""
        return json.dumps({"type": "done", "context_id": cid, "reason": reason, "samples": self.track.forget(cid)},
                          separators=(",", ":"))

    async def _send_text(self, text: str) -> None:
        msg = json.loads(text)
        kind, cid = msg.get("type"), msg.get("context_id")
        if kind == "audio_start":
            self._playing, self._playing_cancelled = cid, False
            self.track.mark(text, tag=cid)
        elif kind == "chunk":  # a session configured for base64 audio: audio still goes to the track
            await self._send_bytes(base64.b64decode(msg["data"]))
        elif kind == "done" and cid == self._playing:
            if self._playing_cancelled or msg["reason"] == "error":  # an error (its message went at once) ends
                self.track.drop(cid)  # the context now, as over a WebSocket: the audio still queued is dropped
                self._send_now(self._played_done(cid, msg["reason"]))
            else:
                self.track.mark(text, tag=cid)
            self._playing, self._playing_cancelled = None, False
        else:
            self._send_now(text)

    async def _send_bytes(self, pcm: bytes) -> None:
        assert self._playing is not None, "audio outside audio_start ... done"
        cid = self._playing

        def wanted() -> bool:  # not cancelled, also while the write waited for room in the track
            return self._playing == cid and not self._playing_cancelled

        if not wanted():
            return
        try:
            await self.track.write(pcm, tag=cid, wanted=wanted)
        except MediaStreamError as e:
            raise ConnectionError(f"peer {self.id}: track ended") from e

    def _send_marker(self, text: str) -> None:
        """Called from the track's `recv()`: must not raise into aiortc's sender loop."""
        msg = json.loads(text)
        sent = self.channel is not None and self.channel.readyState == "open"
        if sent:
            self.channel.send(text)
        # else: the peer is gone and its session is ending; there is no one to tell
        if msg["type"] == "done":
            self.track.forget(msg["context_id"])
            if self._runner is not None:  # a completed context is counted when its done plays
                if sent:
                    self._runner.played(msg["context_id"])
                else:
                    self._runner.unplayed(msg["context_id"], "disconnected")

    def _send_now(self, text: str) -> None:
        channel = self.channel
        if channel is None or channel.readyState != "open":
            raise ConnectionError(f"peer {self.id}: data channel is not open")
        channel.send(text)

    async def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self._inbox.put_nowait(None)
        self.track.stop()
        await self.pc.close()
        if self._task is not None and self._task is not asyncio.current_task():
            await asyncio.gather(self._task, return_exceptions=True)


# ---------------------------------------------------------------- signaling

PEERS = web.AppKey("higgs_webrtc_peers", dict)


def _parse_offer(body: bytes, limit: int) -> RTCSessionDescription:
    msg = parse_json(body, limit)
    check_unicode(msg, body)
    if not isinstance(msg.get("sdp"), str) or msg.get("type") != "offer":
        raise InvalidInputError('offer must be {"sdp": str, "type": "offer"}')
    sdp, dropped = drop_mdns_candidates(msg["sdp"])
    if dropped:
        log.debug("dropped %d mDNS (.local) candidate(s) from an offer", dropped)
    candidates = sum(line.startswith("a=candidate:") for line in sdp.splitlines())
    if candidates > MAX_OFFER_CANDIDATES:
        raise TooLargeError(f"the offer has {candidates} ICE candidates, limit {MAX_OFFER_CANDIDATES}")
    return RTCSessionDescription(sdp=sdp, type="offer")


def receives_audio(sdp: str) -> bool:
    """Whether an offer (already parsed once by aiortc) has an audio section the peer receives on: not rejected
    (port 0), and recvonly or sendrecv (SDP's default). A sendonly or inactive one would be answered with a track
    that plays to nobody while its generation runs."""
    return any(m.kind == "audio" and m.port != 0 and m.direction in (None, "sendrecv", "recvonly")
               for m in SessionDescription.parse(sdp).media)


def drop_mdns_candidates(sdp: str) -> tuple[str, int]:
    """(`sdp` without its `a=candidate` lines whose address is an mDNS name `*.local`, how many).

    Browsers hide host addresses behind mDNS names; aioice tries to resolve each for 1 s before
    answering, and cannot reach them anyway. The browser still finds the server through the
    answer's candidates (its checks arrive as peer-reflexive candidates), so nothing is lost.
    """
    kept, dropped = [], 0
    for line in sdp.splitlines(keepends=True):
        fields = line.split()
        if line.startswith("a=candidate:") and len(fields) > 4 and fields[4].rstrip(".").lower().endswith(".local"):
            dropped += 1
            continue
        kept.append(line)
    return "".join(kept), dropped


def ice_configuration(urls: tuple[str, ...]) -> RTCConfiguration:
    """Peer connection configuration from `ServerConfig.ice_servers` (validated there). An empty
    list means host candidates only: aiortc's default would ask a public STUN server each offer."""
    servers = []
    for url in urls:
        m = ICE_SERVER.fullmatch(url)
        plain = f"{m['scheme']}:{m['host']}" + (f":{m['port']}" if m["port"] else "") + (
            f"?transport={m['transport']}" if m["transport"] else "")
        servers.append(RTCIceServer(plain, username=m["username"], credential=m["credential"]))
    return RTCConfiguration(iceServers=servers)


async def offer(request: web.Request) -> web.Response:
    """POST /v1/webrtc/offer {sdp, type:"offer"} -> {sdp, type:"answer", pc_id} (non-trickle ICE)."""
    state = request.app[STATE]
    cfg = state.config
    peers: dict[str, WebRTCPeer] = request.app[PEERS]
    try:
        view = request_view(request)
        check_request(view, cfg, json_body=True)
        description = _parse_offer(await read_body(view, cfg), cfg.max_message_bytes)
        if len(peers) >= cfg.max_streams:
            raise CapacityError(f"server holds its limit of {cfg.max_streams} WebRTC peers")
    except HiggsStreamError as e:
        return error_response(e, state.metrics)

    pc = RTCPeerConnection(ice_configuration(cfg.ice_servers))
    peer = WebRTCPeer(state, pc)
    peers[peer.id] = peer  # before the first await: concurrent offers count it (300 at once all passed the check)
    pc.on("datachannel", peer.attach)

    @pc.on("connectionstatechange")
    async def on_state() -> None:
        if pc.connectionState == "connected":
            peer.connected.set()
        elif pc.connectionState in ("failed", "closed"):
            await peer.close()

    try:
        try:
            await pc.setRemoteDescription(description)
        except Exception as e:  # aiortc's SDP parser: ValueError, IndexError, KeyError, AssertionError, ...
            raise InvalidInputError(f"bad offer SDP: {type(e).__name__}: {e}") from e
        if not any(t.kind == "audio" for t in pc.getTransceivers()):
            raise InvalidInputError("the offer has no audio transceiver")
        if not receives_audio(description.sdp):  # answered, it would get a track nobody plays
            raise InvalidInputError("the offer's audio must be recvonly or sendrecv: the server sends the speech")
        pc.addTrack(peer.track)
        try:
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as e:  # an offer aiortc parsed but cannot answer (no common codec, ...)
            log.info("cannot answer an offer", exc_info=True)
            raise InvalidInputError(f"cannot answer this offer: {type(e).__name__}: {e}") from e
    except HiggsStreamError as e:
        peers.pop(peer.id, None)
        await peer.close()  # the peer connection is never left open
        return error_response(e, state.metrics)
    except BaseException:
        peers.pop(peer.id, None)
        await peer.close()
        raise

    async def watch() -> None:  # forget the peer when it closes; close it if it never connects or opens no channel
        for event, what in ((peer.connected, "connect"), (peer.attached, "open a data channel")):
            try:
                await asyncio.wait_for(event.wait(), CONNECT_TIMEOUT_S)
            except TimeoutError:
                log.info("peer %s did not %s within %.0f s", peer.id, what, CONNECT_TIMEOUT_S)
                await peer.close()
                break
        await peer.closed.wait()
        peers.pop(peer.id, None)

    peer.watcher = asyncio.create_task(watch(), name=f"webrtc-watch-{peer.id}")
    return web.json_response({"sdp": pc.localDescription.sdp, "type": pc.localDescription.type, "pc_id": peer.id})


def add_routes(app: web.Application, state: ServerState) -> None:
    """Mount `POST /v1/webrtc/offer`; open peers are closed at shutdown (before the pipeline stops)."""
    app[PEERS] = {}
    app.router.add_post("/v1/webrtc/offer", offer)

    async def close_peers(app: web.Application) -> None:
        await asyncio.gather(*(peer.close() for peer in list(app[PEERS].values())))

    app.on_shutdown.append(close_peers)
