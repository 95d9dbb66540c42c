"""stream/server_state.py `listening_sockets`: the sockets both transports listen on, and the send buffer every
connection they accept inherits (`ServerConfig.send_buffer_kib`)."""

from __future__ import annotations

import socket
import sys

import pytest
from higgs_stream.stream.server_state import listening_sockets


def test_sockets_are_tcp_with_the_send_buffer_and_connections_inherit_it():
    socks = listening_sockets("127.0.0.1", 0, 64 * 1024)
    try:
        assert len(socks) == 1
        sock = socks[0]
        assert sock.proto == socket.IPPROTO_TCP  # asyncio sets TCP_NODELAY only on these
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        listener_buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert listener_buffer >= 64 * 1024  # Linux keeps twice what is asked (within net.core.wmem_max)
        sock.listen(1)
        with socket.create_connection((host, port), timeout=5):
            accepted, _ = sock.accept()
            with accepted:
                if sys.platform.startswith("linux"):  # what the server relies on: an accepted socket inherits it
                    assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == listener_buffer
    finally:
        for s in socks:
            s.close()


def test_no_buffer_leaves_the_kernel_default():
    with socket.socket() as plain:
        default = plain.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    socks = listening_sockets("127.0.0.1", 0, None)
    try:
        assert socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == default
    finally:
        socks[0].close()


def test_a_taken_port_raises_and_leaves_nothing_open():
    taken = listening_sockets("127.0.0.1", 0, None)[0]
    taken.listen(1)
    try:
        with pytest.raises(OSError):
            listening_sockets("127.0.0.1", taken.getsockname()[1], None)
    finally:
        taken.close()


def test_a_name_binds_every_address_it_resolves_to():
    addresses = {info[4][:2] for info in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)}
    socks = listening_sockets("localhost", 0, None)
    try:
        assert 1 <= len(socks) <= len(addresses)  # an address of a family the machine lacks is skipped
        assert all(s.getsockname()[0] in {a for a, _ in addresses} for s in socks)
    finally:
        for s in socks:
            s.close()


def test_an_unknown_host_is_a_resolver_error():
    with pytest.raises(socket.gaierror):
        listening_sockets("no-such-host.invalid", 0, None)
