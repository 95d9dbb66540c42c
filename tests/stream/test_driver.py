"""SessionRunner (stream/driver.py) over a fake channel: what it reads and when."""

from __future__ import annotations

import time
import weakref
from types import SimpleNamespace

from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.driver import SessionRunner
from higgs_stream.stream.metrics import Metrics


async def test_a_flood_is_read_at_the_sessions_message_rate(voices):
    """300 bad messages at once into a session allowed 200 a second (bursts of 200): all are answered, and reading
    them takes at least the (300 - 200) / 200 s the budget needs to refill; the sender waits, not the server. (A
    probe's 1M messages in 15 s on one socket slowed every other client from 0.6 to 15 s a request.)"""
    state = SimpleNamespace(config=ServerConfig(max_messages_per_s=200), voices=voices, sessions=weakref.WeakSet(),
                            metrics=Metrics())
    sent: list[str] = []

    async def send_text(text: str) -> None:
        sent.append(text)

    async def send_bytes(data: bytes) -> None:
        raise AssertionError("no audio here")

    messages = iter(['{"type": "nope"}'] * 300)

    async def receive():
        return next(messages, None)

    runner = SessionRunner(state, send_text, send_bytes)
    t0 = time.monotonic()
    await runner.run(receive)
    assert time.monotonic() - t0 >= 0.45  # 0.5 s of refill (less a timer's rounding)
    assert state.metrics.errors.value(code="unknown_type") == 300
