"""Chunk schedule for the Code2Wav streaming adapter: plain-Python planning over the codec's geometry.

Nothing here is a Higgs constant: the codec declares its geometry (`engine.codec.geometry.
CodecGeometry`: hop, one-sided receptive field, look-ahead of its stateful decoder, causal or not)
and the planner works from it.

Two decode paths, both planned here:
- stateful (every chunk in exact mode; every chunk after the ramp in low-latency mode): frames are
  pushed once into the codec's `StreamingDecoder`, which emits each output sample as soon as it is
  exact: after P frames pushed, samples [0, P*hop - lookahead) exist (all P*hop after the final
  push). Chunk k (`chunk_size(k)` frames of audio) is due once enough frames are known for the
  decoder to cover it: P_k = ceil((emitted + size_k*hop + lookahead) / hop).
- windowed (low-latency ramp only, non-causal codecs): chunk k < len(ramp) decodes a window
  [receptive_field left | new | ramp holdback < look-ahead] one-shot and keeps the new frames:
  approximate, sooner. Meanwhile frames are pushed into the stateful decoder only as far as its
  output stays behind what the windows emitted, so when the ramp ends the stateful path simply
  continues (exact from there), with no re-decode.

The engine hands codec frames (its model family's writer has reverted whatever pattern the
talker emits in), so time to first audio here is in frames: `first_chunk_frames(cfg, geometry)`.
Exact default on the Higgs codec: 11 frames (1 of audio + 9458 samples of look-ahead);
low-latency default: 1 + 4 = 5. How many engine steps a frame takes is the talker's business
(a delay-pattern talker adds its delay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.errors import ConfigError

MODES = ("exact", "low_latency")
# Low-latency default: holdbacks (frames) of the first chunks, decoded as windows. TTFA 5 frames
# instead of 11 on the Higgs codec; exact (stateful) after these chunks.
LOW_LATENCY_RAMP = (4, 4, 4, 6, 8)
# Low-latency under load (`loaded_config`): only the first chunk, sized for the load, is a window, with this holdback;
# the stateful decoder takes over from chunk 1 (fewer window shapes to warm up, one transition to size for).
LOADED_RAMP = LOW_LATENCY_RAMP[:1]


@dataclass(frozen=True)
class AdapterConfig:
    """How a stream's frames are cut into chunks.

    mode: "exact" (every emitted sample equals the one-shot decode to fp32 rounding) or
        "low_latency" (the first chunks are decoded sooner from windows with a short holdback:
        approximate there, measured by SNR; exact after the ramp).
    schedule: chunk sizes in frames of audio; chunk k >= len(schedule) uses schedule[-1]. Never
        shrinks (a shrinking schedule starves a listener that plays chunk 0 at once).
    ramp_holdbacks: low-latency holdbacks (frames) of the first chunks; None = LOW_LATENCY_RAMP.
        Each must stay below the codec's look-ahead (a longer one is exact: use exact mode).
    """

    mode: str = "exact"
    schedule: tuple[int, ...] = (1, 2, 4, 8, 16, 25)
    ramp_holdbacks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", tuple(self.schedule))
        if self.mode not in MODES:
            raise ConfigError(f"adapter mode must be one of {MODES}, got {self.mode!r}")
        if not self.schedule or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in self.schedule):
            raise ConfigError(f"schedule must be positive integers, got {self.schedule}")
        if any(b < a for a, b in zip(self.schedule, self.schedule[1:])):
            raise ConfigError(f"schedule must never shrink, got {self.schedule}")
        if self.ramp_holdbacks is not None:
            ramp = tuple(self.ramp_holdbacks)
            if any(not isinstance(h, int) or h < 0 for h in ramp):
                raise ConfigError(f"ramp_holdbacks must be non-negative integers, got {ramp}")
            if self.mode == "exact" and ramp:
                raise ConfigError("ramp_holdbacks belong to low_latency mode (exact mode has no ramp)")
            object.__setattr__(self, "ramp_holdbacks", ramp)

    def chunk_size(self, k: int) -> int:
        """Frames of audio in chunk k (0-based)."""
        return self.schedule[min(k, len(self.schedule) - 1)]

    def ramp(self, geometry: CodecGeometry) -> tuple[int, ...]:
        """Holdbacks of the windowed ramp chunks on this codec (none in exact mode or on a causal codec)."""
        if self.mode == "exact" or geometry.lookahead_samples == 0:
            return ()
        ramp = LOW_LATENCY_RAMP if self.ramp_holdbacks is None else self.ramp_holdbacks
        if any(h * geometry.hop >= geometry.lookahead_samples for h in ramp):
            raise ConfigError(f"ramp holdbacks {ramp} must stay below the codec's look-ahead "
                              f"({geometry.lookahead_samples} samples = {geometry.lookahead_samples / geometry.hop:.2f} frames)")
        return ramp


@dataclass(frozen=True)
class Window:
    """A windowed (ramp) chunk in frames: decode [start, stop) one-shot, emit [emit_from, emit_from + new)."""

    start: int
    stop: int
    emit_from: int
    new: int
    chunks: int

    @property
    def left(self) -> int:
        return self.emit_from - self.start


@dataclass(frozen=True)
class Push:
    """Frames [start, stop) into the stateful decoder (`final`: the utterance ends with them).

    The decoder returns its output samples [out_from, out_to); samples before `emit_from` were
    already emitted by ramp windows and are dropped, so the chunk is [max(out_from, emit_from), out_to).
    """

    start: int
    stop: int
    final: bool
    out_from: int
    out_to: int
    emit_from: int

    @property
    def frames(self) -> int:
        return self.stop - self.start

    @property
    def emit_start(self) -> int:
        """The first output sample this push emits (the ramp may have sent earlier ones)."""
        return max(self.out_from, self.emit_from)

    @property
    def emits(self) -> int:
        return max(0, self.out_to - self.emit_start)


class ChunkPlanner:
    """Plain-Python bookkeeping of one stream: which frames go where, and when."""

    def __init__(self, cfg: AdapterConfig, geometry: CodecGeometry) -> None:
        self.cfg, self.geometry = cfg, geometry
        self.ramp = cfg.ramp(geometry)
        self.available = 0  # audio frames known
        self.pushed = 0  # frames pushed into the stateful decoder
        self.emitted = 0  # samples emitted (windows + stateful)
        self.chunk_index = 0  # next chunk of the schedule
        self.finished = False  # no more frames will come
        self.flushed = False  # the final push was planned

    # ---- arithmetic ----
    def decoder_out(self, pushed: int, final: bool = False) -> int:
        """Samples the stateful decoder has emitted after `pushed` frames (all of them once final)."""
        hop = self.geometry.hop
        return pushed * hop if final else max(0, pushed * hop - self.geometry.lookahead_samples)

    def frames_for(self, samples: int) -> int:
        """Frames that must be pushed before the stateful decoder has emitted `samples` samples."""
        return math.ceil((samples + self.geometry.lookahead_samples) / self.geometry.hop)

    @property
    def in_ramp(self) -> bool:
        return self.chunk_index < len(self.ramp)

    @property
    def done(self) -> bool:
        return self.finished and (self.flushed or self.available == 0)

    # ---- planning ----
    def take(self) -> list[Window | Push]:
        """The jobs that are due now (none, one, or a ramp window with its state push), applied."""
        if self.done:
            return []
        if self.finished:
            return [self._push(self.available, final=True)]
        if self.in_ramp:
            return self._take_ramp()
        k, samples, need = self.chunk_index, self.emitted, None
        while self.available >= self.frames_for(samples + self.cfg.chunk_size(k) * self.geometry.hop):
            samples += self.cfg.chunk_size(k) * self.geometry.hop
            need = self.frames_for(samples)
            k += 1
        if need is None:
            return []
        self.chunk_index = k
        return [self._push(need, final=False)]

    def _take_ramp(self) -> list[Window | Push]:
        hop, rf = self.geometry.hop, self.geometry.receptive_field
        assert self.emitted % hop == 0, "ramp windows emit whole frames"
        first = end = self.emitted // hop
        k, stop = self.chunk_index, None
        while k < len(self.ramp) and self.available - end >= self.cfg.chunk_size(k) + self.ramp[k]:
            end += self.cfg.chunk_size(k)
            stop = end + self.ramp[k]
            k += 1
        if stop is None:
            return []
        window = Window(max(0, first - rf), stop, first, end - first, chunks=k - self.chunk_index)
        self.chunk_index, self.emitted = k, end * hop
        jobs: list[Window | Push] = [window]
        # warm the stateful decoder as far as its output stays within what the windows emitted
        reach = min(self.available, (self.emitted + self.geometry.lookahead_samples) // hop)
        if reach > self.pushed:
            jobs.append(self._push(reach, final=False))
        return jobs

    def _push(self, stop: int, final: bool) -> Push:
        push = Push(self.pushed, stop, final, self.decoder_out(self.pushed), self.decoder_out(stop, final),
                    self.emitted)
        self.pushed = stop
        self.emitted = max(self.emitted, push.out_to)
        self.flushed = final
        return push


def load_schedule(first: int, repeat: int, last: int) -> tuple[int, ...]:
    """Chunk sizes from a first chunk of `first` frames: `repeat` chunks of that size, then doubling up to `last`."""
    schedule = [first] * repeat
    while schedule[-1] < last:
        schedule.append(min(last, 2 * schedule[-1]))
    return tuple(schedule)


def loaded_config(mode: str, first: int, repeat: int, last: int) -> AdapterConfig:
    """A segment's plan when its first chunk has `first` frames (`load_schedule`); in low-latency mode with `first`
    above 1 the ramp is LOADED_RAMP: one window, then the stateful decoder."""
    if mode == "exact":
        return AdapterConfig(mode=mode, schedule=load_schedule(first, repeat, last))
    if first == 1:
        return AdapterConfig(mode=mode, schedule=load_schedule(1, 1, last))
    return AdapterConfig(mode=mode, schedule=load_schedule(first, repeat, last), ramp_holdbacks=LOADED_RAMP)


def handover_steps(cfg: AdapterConfig, geometry: CodecGeometry) -> int:
    """Frames chunk 1 waits for beyond its own when chunk 0 is the plan's only window (a `loaded_config` in
    low-latency mode): the stateful decoder needs the look-ahead's frames after chunk 1's last, a window only its
    holdback. 0 for any other plan (exact, the whole ramp, a causal codec)."""
    ramp = cfg.ramp(geometry)
    return geometry.lookahead_frames - ramp[0] if len(ramp) == 1 else 0


def window_lengths(cfg: AdapterConfig, geometry: CodecGeometry) -> set[int]:
    """Frames of every ramp window the plan decodes when its frames arrive one at a time (the shapes a GPU codec
    warms up; none in exact mode or on a causal codec)."""
    planner, lengths = ChunkPlanner(cfg, geometry), set()
    while planner.in_ramp:
        planner.available += 1
        lengths |= {j.stop - j.start for j in planner.take() if isinstance(j, Window)}
    return lengths


def first_chunk_frames(cfg: AdapterConfig, geometry: CodecGeometry) -> int:
    """Frames that must arrive before the first chunk can be emitted."""
    ramp = cfg.ramp(geometry)
    return (cfg.chunk_size(0) + ramp[0] if ramp
            else math.ceil((cfg.chunk_size(0) * geometry.hop + geometry.lookahead_samples) / geometry.hop))


def max_step_ratio(cfg: AdapterConfig, geometry: CodecGeometry, horizon: int = 64) -> float:
    """Largest (seconds per AR step + codec time) / (seconds per frame) that never underruns.

    A listener that starts playing when chunk 0 arrives needs chunk k before chunk 0's start plus
    the audio of chunks 0..k-1. Chunk k leaves once n_k frames are known, chunk 0 at n_0, so with
    a steady step ratio rho (1.0 = real time) playback is continuous iff
    rho * (n_k - n_0) * hop <= audio before chunk k, for every k. A growing schedule can therefore
    never be continuous at exactly real time: the default doubling schedule needs rho <= ~0.5.
    """
    planner = ChunkPlanner(cfg, geometry)
    best, n0, played = float("inf"), None, 0
    while planner.chunk_index < horizon:
        planner.available += 1
        jobs = planner.take()
        emitted = sum(j.new * geometry.hop if isinstance(j, Window) else j.emits for j in jobs)
        if not emitted:
            continue
        if n0 is None:
            n0 = planner.available
        elif planner.available > n0:
            best = min(best, played / ((planner.available - n0) * geometry.hop))
        played += emitted
    return best
