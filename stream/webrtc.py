"""WebRTC transport: an aiortc audio track paced on the wall clock, plus HTTP offer/answer signaling.

The track plays s16le mono PCM in 20 ms frames at the wall-clock rate and sends silence when
nothing is queued, so the RTP clock never stops. Markers written between PCM chunks fire when
playout reaches them: the data channel's `audio_start` / `done` events line up with what the
listener hears, not with when the server generated it.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame

SAMPLE_WIDTH = 2  # bytes per s16 sample


class PacedPCMTrack(MediaStreamTrack):
    """An audio track fed with s16le mono PCM; `recv()` paces 20 ms frames on the wall clock.

    `write(pcm)` queues audio (it waits while more than `max_buffer_s` is queued: the writer, not
    the network, is held back); `mark(payload)` queues a marker that is handed to `on_marker`
    when playout passes it; `clear()` drops everything queued (barge-in).
    """

    kind = "audio"

    def __init__(
        self,
        sample_rate: int = 24000,
        ptime: float = 0.020,
        max_buffer_s: float = 10.0,
        on_marker: Callable[[Any], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__()
        assert sample_rate > 0 and ptime > 0, f"bad sample_rate {sample_rate} / ptime {ptime}"
        self.sample_rate = sample_rate
        self.frame_samples = round(sample_rate * ptime)
        assert self.frame_samples > 0, "ptime too small for the sample rate"
        self.max_buffer_samples = round(max_buffer_s * sample_rate)
        self.on_marker = on_marker
        self._clock = clock
        self._time_base = fractions.Fraction(1, sample_rate)
        self._pcm = bytearray()  # queued, not yet sent
        self._written = 0  # samples ever queued (absolute position of the write end)
        self._read = 0  # samples ever sent from the queue
        self._markers: deque[tuple[int, Any]] = deque()  # (absolute sample position, payload)
        self._space = asyncio.Event()  # set while the queue is under max_buffer_samples
        self._space.set()
        self._start: float | None = None
        self._pts = 0
        # Counters for tests and metrics.
        self.frames_sent = 0
        self.audio_samples_sent = 0  # samples that came from the queue (not padding)

    @property
    def buffered_samples(self) -> int:
        return len(self._pcm) // SAMPLE_WIDTH

    @property
    def buffered_s(self) -> float:
        return self.buffered_samples / self.sample_rate

    async def write(self, pcm: bytes) -> None:
        """Queue s16le mono PCM (a whole number of samples); waits while the queue is full."""
        assert len(pcm) % SAMPLE_WIDTH == 0, f"odd PCM byte count {len(pcm)}"
        while self.buffered_samples >= self.max_buffer_samples:
            self._space.clear()
            await self._space.wait()
        if self.readyState != "live":
            raise MediaStreamError("track ended")
        self._pcm += pcm
        self._written += len(pcm) // SAMPLE_WIDTH

    def mark(self, payload: Any) -> None:
        """Hand `payload` to `on_marker` once every sample written so far has been sent."""
        self._markers.append((self._written, payload))

    def clear(self) -> list[Any]:
        """Drop queued audio and pending markers (barge-in); returns the dropped markers' payloads."""
        dropped = [p for _, p in self._markers]
        self._markers.clear()
        self._read += self.buffered_samples
        self._pcm.clear()
        self._space.set()
        return dropped

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError("track ended")
        now = self._clock()
        if self._start is None:
            self._start = now
        else:
            # Frame k goes out at start + k * ptime; late frames go out at once to catch up.
            due = self._start + self._pts / self.sample_rate
            if due > now:
                await asyncio.sleep(due - now)
        frame = self._next_frame()
        self._fire_markers()
        return frame

    def _next_frame(self) -> AudioFrame:
        n = self.frame_samples
        take = min(n, self.buffered_samples)
        samples = np.zeros(n, dtype=np.int16)  # [n] silence unless audio is queued
        if take:
            samples[:take] = np.frombuffer(self._pcm, dtype="<i2", count=take)
            del self._pcm[: take * SAMPLE_WIDTH]
            self._read += take
            self.audio_samples_sent += take
            if self.buffered_samples < self.max_buffer_samples:
                self._space.set()
        frame = AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")  # [1, n]
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        frame.time_base = self._time_base
        self._pts += n
        self.frames_sent += 1
        return frame

    def _fire_markers(self) -> None:
        while self._markers and self._markers[0][0] <= self._read:
            _, payload = self._markers.popleft()
            if self.on_marker is not None:
                self.on_marker(payload)

    def stop(self) -> None:
        self.clear()
        super().stop()
