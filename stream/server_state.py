"""What the aiohttp app shares between its routes (the WebSocket, HTTP and WebRTC handlers):
config, pipeline, voices, metrics and the open sockets, under one app key."""

from __future__ import annotations

import errno
import logging
import socket
import weakref
from dataclasses import dataclass, field

from aiohttp import web
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.gc_pauses import freeze_startup
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.stream.voices import DEFAULT, VoiceLibrary

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    config: ServerConfig
    pipeline: Pipeline
    voices: VoiceLibrary
    metrics: Metrics
    sockets: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # open WebSockets (closed at shutdown)
    sessions: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # live SessionRunners (WebSocket, WebRTC)


STATE = web.AppKey("higgs_state", ServerState)


def limit_send_buffer(sock, nbytes: int | None) -> None:
    """SO_SNDBUF on a socket (`ServerConfig.send_buffer_kib`; None: left to the kernel): on a client connection, or
    on a listening socket, whose accepted connections inherit it (Linux). A socket already closed is left alone."""
    global _capped_warned
    if sock is None or nbytes is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
        got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    except OSError as e:  # the peer went away meanwhile
        log.debug("SO_SNDBUF not set: %r", e)
        return
    if got < nbytes and not _capped_warned:  # Linux caps it at net.core.wmem_max (and reports twice what it keeps)
        _capped_warned = True
        log.warning("--send-buffer-kib %d: the kernel keeps %d KiB (net.core.wmem_max caps it)", nbytes // 1024,
                    got // 1024)


_capped_warned = False  # `limit_send_buffer` warns once a process


def listening_sockets(host: str, port: int, send_buffer_bytes: int | None) -> list[socket.socket]:
    """Bound TCP sockets for every address `host` names (as asyncio's `create_server` binds them; port 0: any free
    port), each with the connection send buffer (`limit_send_buffer`): every connection either transport accepts
    inherits it from its listening socket, so no response sets it again. IPPROTO_TCP (not 0): asyncio sets
    TCP_NODELAY only on sockets that say so, and without it Nagle holds a small frame written right after another for
    the client's delayed ACK (40 ms). An address of a family this machine lacks (IPv6) is skipped while another
    binds. OSError when none can be bound (a taken port); socket.gaierror for a host that resolves to nothing."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                               flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's own bind
                if family == socket.AF_INET6:  # "::" beside "0.0.0.0": each family its own socket
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                limit_send_buffer(sock, send_buffer_bytes)
                sock.bind(address)
            except OSError as e:
                sock.close()
                if e.errno == errno.EADDRNOTAVAIL and len(infos) > 1:
                    continue
                raise
            socks.append(sock)
        if not socks:
            raise OSError(errno.EADDRNOTAVAIL, f"no address of {host!r} can be bound")
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


async def start_pipeline(state: ServerState) -> None:
    """Start the pipeline and, with `config.warm_up`, run one utterance in the default voice through
    it before the transport accepts anyone (both transports: aiohttp's startup, ASGI's lifespan); then,
    with `config.gc_freeze`, freeze start-up's objects out of garbage collection (stream/gc_pauses.py)."""
    await state.pipeline.start()
    if state.config.warm_up:
        # the default voice first; a model that needs a reference voice (Qwen3-TTS Base) warms up with the
        # first preset that has one, if any (else its first client pays for the compilation)
        candidates = [state.voices.resolve(DEFAULT)] + [v for v in state.voices.presets.values() if v.has_reference]
        for voice in candidates:
            if await state.pipeline.warm_up(voice) is not None:
                break
    if state.config.gc_freeze:
        log.info("%d start-up objects frozen out of garbage collection (stream/gc_pauses.py)", freeze_startup())
    state.pipeline.mark_serving()
