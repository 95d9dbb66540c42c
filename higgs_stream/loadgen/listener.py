"""The simulated real-time listener (pure): what a person playing a stream's audio as it arrives
would hear. docs/LOADGEN.md, "The listener and the metrics"."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

SAMPLE_RATE = 24000


@dataclass(frozen=True)
class Playback:
    """What a real-time listener heard of one stream."""

    first: float | None  # arrival time of the first audio (playback starts)
    samples: int
    stalls: tuple[float, ...]  # duration of each underrun (s), in order
    max_gap_s: float  # largest time between two audio arrivals
    stalls_at: tuple[float, ...] = ()  # where in the audio each underrun happened (s of audio played before it)

    @property
    def underruns(self) -> int:
        return len(self.stalls)

    @property
    def stall_s(self) -> float:
        return sum(self.stalls, 0.0)

    @property
    def max_stall_s(self) -> float:
        return max(self.stalls, default=0.0)


def listen(arrivals: Iterable[tuple[float, int]], sample_rate: int = SAMPLE_RATE) -> Playback:
    """Replay (arrival time, samples) in order: playback starts at the first audio and plays
    `sample_rate` samples per second; audio needed before it arrived is a stall lasting until it
    comes, then playback resumes. Arrivals exactly when the buffer runs dry do not stall."""
    first = last = None
    anchor_t, anchor_n, samples = 0.0, 0, 0  # playback (re)started at anchor_t with anchor_n samples delivered
    stalls: list[float] = []
    stalls_at: list[float] = []
    max_gap = 0.0
    for t, n in arrivals:
        if n <= 0:
            continue
        if first is None:
            first, anchor_t, anchor_n = t, t, 0
        else:
            max_gap = max(max_gap, t - last)
            dry_at = anchor_t + (samples - anchor_n) / sample_rate  # when the audio delivered so far runs out
            if t > dry_at:
                stalls.append(t - dry_at)
                stalls_at.append(samples / sample_rate)
                anchor_t, anchor_n = t, samples
        samples += n
        last = t
    return Playback(first, samples, tuple(stalls), max_gap, tuple(stalls_at))
