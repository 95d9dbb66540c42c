"""Chunk schedule for the Code2Wav streaming adapter: configuration and plain-Python planning.

Column space vs frame space. The talker emits one delay-pattern column per AR step; column 0 is the
all-BOS column. Delay frame t is (col[t][0], col[t+1][1], ..., col[t+7][7]), complete once column
t+7 has arrived; delay frame 0 is the stream-BOS frame and the frame completed by the final column
(the end of the EOS ramp-out) is the EOS frame, both dropped (`engine.delay.columns_to_frames`:
L columns -> L-9 audio frames). Audio frame r is delay frame r+1, known after r+9 columns, so
N audio frames need N+8 columns. The engine marks the final column when it hands it over, so a
frame completed by any earlier column is never the EOS frame and can be used at once.

Emission rule: chunk k (size `chunk_size(k)`, holdback `holdback_for(k)`) is emitted as soon as
known frames - emitted >= chunk_size(k) + holdback_for(k). Time to first audio in columns (the BOS
column included): `first_chunk_columns(cfg) = 8 + chunk_size(0) + holdback_for(0)`, i.e. the BOS
column + 7 delay columns + the first chunk + its holdback. Exact default: 8 + 1 + 10 = 19 columns
(the chunk leaves with column index 18); low-latency default: 8 + 1 + 4 = 13.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from higgs_stream.engine.errors import ConfigError

# Output frame f of the Higgs v2 codec decoder depends on latent frames f-10 .. f+10
# (research/higgs_v2_reference.md §2.5; checked again by tests/stream/test_adapter.py).
CODEC_RECEPTIVE_FIELD = 10
NUM_CODEBOOKS = 8
# Columns before N audio frames are known: N + COLUMNS_BEFORE_FIRST_FRAME (BOS column + 7-column delay).
COLUMNS_BEFORE_FIRST_FRAME = NUM_CODEBOOKS

MODES = ("exact", "low_latency")
# Low-latency default: holdbacks of the first chunks, then `holdback` (10). TTFA 13 columns instead
# of 19, and the default schedule still plays without underrun while the talker (plus codec) runs
# at <= 0.4375 of real time (see `max_step_ratio`; the exact default allows 0.5).
LOW_LATENCY_RAMP = (4, 4, 4, 6, 8)


@dataclass(frozen=True)
class AdapterConfig:
    """How a stream's frames are cut into decode windows.

    mode: "exact" (every emitted sample equals the one-shot decode up to fp32 rounding; needs
        left_context and every holdback >= the codec receptive field) or "low_latency" (smaller
        holdbacks on the first chunks; approximate there, measured by SNR).
    schedule: chunk sizes in frames; chunk k >= len(schedule) uses schedule[-1]. Never shrinks.
    left_context: frames re-decoded before the new frames and dropped.
    holdback: frames decoded after the new frames and not emitted (later chunks).
    ramp_holdbacks: holdback of chunk k for k < len(ramp_holdbacks); None = the mode's default
        (exact: none, low_latency: LOW_LATENCY_RAMP).
    receptive_field: the codec's one-sided receptive field in frames.
    """

    mode: str = "exact"
    schedule: tuple[int, ...] = (1, 2, 4, 8, 16, 25)
    left_context: int = 10
    holdback: int = 10
    ramp_holdbacks: tuple[int, ...] | None = None
    receptive_field: int = CODEC_RECEPTIVE_FIELD
    _ramp: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", tuple(self.schedule))
        if self.mode not in MODES:
            raise ConfigError(f"adapter mode must be one of {MODES}, got {self.mode!r}")
        if not self.schedule or any(not isinstance(s, int) or s < 1 for s in self.schedule):
            raise ConfigError(f"schedule must be positive integers, got {self.schedule}")
        if any(b < a for a, b in zip(self.schedule, self.schedule[1:])):
            raise ConfigError(f"schedule must never shrink, got {self.schedule}")
        for name in ("left_context", "holdback", "receptive_field"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if self.ramp_holdbacks is None:
            ramp = LOW_LATENCY_RAMP if self.mode == "low_latency" else ()
        else:
            ramp = tuple(self.ramp_holdbacks)
        if any(not isinstance(h, int) or h < 0 for h in ramp):
            raise ConfigError(f"ramp_holdbacks must be non-negative integers, got {ramp}")
        object.__setattr__(self, "_ramp", ramp)
        if self.mode == "exact":
            rf = self.receptive_field
            if self.left_context < rf:
                raise ConfigError(f"exact mode needs left_context >= {rf} frames, got {self.left_context}")
            smallest = min((self.holdback, *ramp))
            if smallest < rf:
                raise ConfigError(f"exact mode needs every holdback >= {rf} frames, got {smallest}")

    def chunk_size(self, k: int) -> int:
        """Frames emitted by chunk k (0-based)."""
        return self.schedule[min(k, len(self.schedule) - 1)]

    def holdback_for(self, k: int) -> int:
        """Right holdback (frames decoded, not emitted) of chunk k."""
        return self._ramp[k] if k < len(self._ramp) else self.holdback

    def exact_chunk(self, k: int) -> bool:
        """Whether chunk k's samples equal the one-shot decode (before the final flush)."""
        return self.left_context >= self.receptive_field and self.holdback_for(k) >= self.receptive_field


def first_chunk_columns(cfg: AdapterConfig) -> int:
    """Columns (BOS column included) that must arrive before the first chunk can be emitted."""
    return COLUMNS_BEFORE_FIRST_FRAME + cfg.chunk_size(0) + cfg.holdback_for(0)


def max_step_ratio(cfg: AdapterConfig, horizon: int = 64) -> float:
    """Largest (seconds per AR step + codec time) / (seconds per frame) that never underruns.

    A listener that starts playing when chunk 0 arrives needs chunk k before chunk 0's start plus
    E_k frames of audio (E_k = frames in chunks 0..k-1). Chunk k leaves after
    E_k + s_k + h_k - s_0 - h_0 more columns, so with a steady step ratio rho (1.0 = real time)
    playback is continuous iff rho * (E_k + s_k + h_k - s_0 - h_0) <= E_k for every k.
    A growing schedule can therefore never be continuous at exactly real time (rho = 1): the
    default (1, 2, 4, ...) doubles and needs rho <= 0.5.
    """
    s0, h0 = cfg.chunk_size(0), cfg.holdback_for(0)
    best = float("inf")
    emitted = 0
    for k in range(horizon):
        s, h = cfg.chunk_size(k), cfg.holdback_for(k)
        if k > 0:
            wait = emitted + s + h - s0 - h0
            if wait > 0:
                best = min(best, emitted / wait)
        emitted += s
    return best


@dataclass(frozen=True)
class Window:
    """One decode window in audio frames: decode [start, stop), emit [emit_from, emit_from + new)."""

    start: int
    stop: int
    emit_from: int
    new: int
    chunks: int  # scheduled chunks this window covers (0 for the final flush)
    final: bool  # the window runs to the true end of the utterance

    @property
    def left(self) -> int:
        return self.emit_from - self.start

    @property
    def right(self) -> int:
        return self.stop - self.emit_from - self.new


class ChunkPlanner:
    """Plain-Python bookkeeping of one stream: which frames go into the next decode window."""

    def __init__(self, cfg: AdapterConfig) -> None:
        self.cfg = cfg
        self.available = 0  # audio frames known (reverted, never the EOS frame)
        self.emitted = 0  # audio frames already emitted
        self.chunk_index = 0  # index of the next chunk in the schedule
        self.finished = False
        self._due_at = cfg.chunk_size(0) + cfg.holdback_for(0)  # `available` that makes chunk_index due

    def due(self) -> bool:
        """Whether `next_window()` would return a window (a cheap check for every column)."""
        if self.finished:
            return self.available > self.emitted
        return self.available >= self._due_at

    def next_window(self) -> Window | None:
        """The next decode window, or None when nothing is due.

        Several scheduled chunks that are all due (a backlog) merge into one window. After
        finish, the window runs to the true end of the utterance (holdback 0: the codec sees the
        same zero padding there as a one-shot decode).
        """
        cfg, avail, emitted = self.cfg, self.available, self.emitted
        start = max(0, emitted - cfg.left_context)
        if self.finished:
            if avail <= emitted:
                return None
            return Window(start, avail, emitted, avail - emitted, chunks=0, final=True)
        k, end, stop = self.chunk_index, emitted, None
        while avail - end >= cfg.chunk_size(k) + cfg.holdback_for(k):
            end += cfg.chunk_size(k)
            stop = end + cfg.holdback_for(k)
            k += 1
        if stop is None:
            return None
        return Window(start, stop, emitted, end - emitted, chunks=k - self.chunk_index, final=False)

    def advance(self, window: Window) -> None:
        """Record that `window` was taken (its frames count as emitted)."""
        assert window.emit_from == self.emitted, f"stale window {window} (emitted {self.emitted})"
        assert window.new > 0, f"a window must emit at least one frame: {window}"
        self.chunk_index += window.chunks
        self.emitted += window.new
        k = self.chunk_index
        self._due_at = self.emitted + self.cfg.chunk_size(k) + self.cfg.holdback_for(k)
