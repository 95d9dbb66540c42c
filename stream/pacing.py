"""Deadline-aware scheduling in plain Python: playback clocks, pausing streams far ahead, admission.

Every stream has a playback clock: its listener starts playing at its first audio and plays in
real time, so at time t it has `ahead_s = sent_s - (t - first_audio)` seconds of audio left
(negative: it is starving). Three decisions follow from the clocks and one measured number, the
engine loop's time per step at a given batch (`LoopModel`):

- the codec serves the streams that run dry first (their `deadline = first_audio + sent_s`; a
  stream without audio yet is the most urgent): `stream/codec_worker.py` orders by it;
- while the GPU is saturated (a loop step takes more than `saturated_ratio` of a frame), the
  talker pauses streams more than `pause_ahead_s` ahead of their listener and resumes them below
  `resume_ahead_s` (hysteresis), so arrivals and late streams get the steps (`Pacer`); only while
  some other stream is not far ahead, and never with the talker left idle (all paused: resume);
- at low load: while a stream waits for its first audio and at most `yield_max_streams` others
  exist, those more than `yield_ahead_s` ahead skip steps, so the newcomer's prompt and first
  frames run alone: a Qwen3-TTS frame step is ~9 ms at any small batch, and a prompt admitted
  beside a playing stream ran both graphs back to back (18 ms) before its first frame (H100 trace,
  1 request/s). Not under load: with no cap, streams could no longer run ahead while others start
  (H100, v2 closed loop of 128: 157 vs 266 audio-s/s);
- admission refuses a new stream (`busy`, Retry-After) when the predicted step time with one more
  stream would leave any stream below `admit_ratio` x real time (`LoopModel.admits`): the doubling
  chunk schedule needs about 2x real time while it ramps up (`chunking.max_step_ratio`).

No torch, no asyncio: the pipeline's engine thread calls `Pacer.plan` before each step and
`LoopModel.observe` after it; the event loop asks `LoopModel.admits` at `open()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from higgs_stream.engine.errors import ConfigError


@dataclass(frozen=True)
class PacingConfig:
    frame_s: float = 0.04  # seconds of audio per AR step (one frame)
    pause_ahead_s: float = 1.5  # pause a stream this far ahead of its listener (GPU saturated)
    resume_ahead_s: float = 1.0  # resume it when its listener is this close
    saturated_ratio: float = 0.1  # the GPU counts as saturated above this many frames of time per step
    admit_ratio: float | None = 0.5  # admit while the predicted step stays under this share of a frame (None: off)
    # low load: while a stream waits for its first audio and at most yield_max_streams others run, skip those this far
    # ahead; while every stream is that far ahead and none waits, step synchronously (None: off)
    yield_ahead_s: float | None = 1.0
    yield_max_streams: int = 4

    def __post_init__(self) -> None:
        if not self.frame_s > 0:
            raise ConfigError(f"frame_s must be > 0, got {self.frame_s}")
        if not 0 <= self.resume_ahead_s < self.pause_ahead_s:
            raise ConfigError(f"need 0 <= resume_ahead_s ({self.resume_ahead_s}) < pause_ahead_s ({self.pause_ahead_s})")
        if not 0 < self.saturated_ratio <= 1:
            raise ConfigError(f"saturated_ratio must be in (0, 1], got {self.saturated_ratio}")
        if self.admit_ratio is not None and not 0 < self.admit_ratio <= 1:
            raise ConfigError(f"admit_ratio must be in (0, 1] or None, got {self.admit_ratio}")
        if self.yield_ahead_s is not None and not self.yield_ahead_s >= 0:
            raise ConfigError(f"yield_ahead_s must be >= 0 or None, got {self.yield_ahead_s}")
        if self.yield_max_streams < 1:
            raise ConfigError(f"yield_max_streams must be >= 1, got {self.yield_max_streams}")


class PlaybackClock:
    """One stream's listener, seen from the server: audio sent vs wall time since its first audio."""

    __slots__ = ("start", "sent_s")

    def __init__(self) -> None:
        self.start: float | None = None  # when the first audio left (monotonic seconds)
        self.sent_s = 0.0

    def sent(self, now: float, seconds: float) -> None:
        if self.start is None:
            self.start = now
        self.sent_s += seconds

    def ahead_s(self, now: float) -> float:
        """Audio the listener still has; -inf before the first audio (it is waiting for it)."""
        return -math.inf if self.start is None else self.sent_s - (now - self.start)

    def deadline(self, now: float) -> float:
        """When the listener runs dry of what was sent (now, before the first audio)."""
        return now if self.start is None else self.start + self.sent_s


def relaxed(now: float, clocks: dict[int, PlaybackClock], cfg: PacingConfig) -> bool:
    """Low load with nothing to hurry: at most `yield_max_streams` streams, each more than `yield_ahead_s`
    ahead of its listener, none waiting for its first audio. The engine then steps synchronously: nothing
    is gained by queueing a step behind the running one, and a prompt arriving next would wait for both
    (Qwen3-TTS: two 9 ms frame steps). Not under load: synchronous steps at 128 streams cut v2's
    closed-loop throughput by a third (H100)."""
    mark = cfg.yield_ahead_s
    return (mark is not None and 0 < len(clocks) <= cfg.yield_max_streams
            and all(c.ahead_s(now) > mark for c in clocks.values()))


RECENT_WEIGHT = 0.2  # LoopModel.last_s: weight of the newest step (reacts within ~10 steps)
SLOPE_PRIOR_ROWS2 = 1.0  # LoopModel.predict: ridge on the rows' variance (rows^2), see there


class LoopModel:
    """Engine loop seconds per step vs decode rows, as an exponentially weighted linear fit (the codec worker fits
    its calls' seconds vs codec frames with it too)."""

    def __init__(self, decay: float = 0.02) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.last_s = 0.0  # the recent loop time (a fast EMA, any batch)
        self._carried_s = 0.0  # time of loop iterations that returned no row yet (observe_iteration)

    def observe_iteration(self, rows: int, seconds: float, cap_s: float) -> None:
        """One engine-loop iteration that returned `rows` rows: an iteration with none (a prompt-only launch, a
        wait that collected only prompts) is carried into the next one with rows, so a decode step's time is the
        whole cycle between its rows. Higgs v3 in a burst of arrivals: iterations of 0 rows and ~25 ms (late prompt
        launches) alternated with ~1 ms ones of 70 rows; fitted one by one they predicted ~12 ms a step where a
        cycle took ~26 (H100 trace, session 17). `cap_s` bounds one observation (a first-use stall must not
        dominate the fit for minutes)."""
        if rows == 0:
            self._carried_s += seconds
            return
        self.observe(rows, min(seconds + self._carried_s, cap_s))
        self._carried_s = 0.0

    def idle(self) -> None:
        """The engine has no work: time carried from row-less iterations belongs to no step."""
        self._carried_s = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        keep = 1.0 - self.decay
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + rows
        self._y = self._y * keep + seconds
        self._xx = self._xx * keep + rows * rows
        self._xy = self._xy * keep + rows * seconds
        self.last_s = seconds if self._w == 1.0 else self.last_s + RECENT_WEIGHT * (seconds - self.last_s)

    def predict(self, rows: int) -> float | None:
        """Seconds per step at `rows` decode rows (None before any observation)."""
        if self._w == 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        # ridge: a slope needs rows that vary. Paced streams can run one row a step for minutes; a few
        # two-row steps of 17-18 ms then sloped a plain fit ~9 ms a row, and a served Qwen3-TTS 1.7B
        # refused a sixth stream at 1 request/s (53 ms predicted, ~9 ms real; its H100 trace replayed).
        # Under load rows spread over tens (variance 28-1,460 in v2/v3 traces): the prior moves <= 0.5 ms.
        slope = max(0.0, (self._xy / self._w - mx * my) / (var + SLOPE_PRIOR_ROWS2))
        return max(my + slope * (rows - mx), my if rows >= mx else 0.0)

    def admits(self, streams: int, cfg: PacingConfig) -> bool:
        """Whether one more stream keeps the predicted step under `admit_ratio` of a frame (always,
        with admission by load off, and always with no stream running: the model learns only from
        steps, so refusing an idle server on old observations would refuse it forever)."""
        if streams == 0:
            return True
        t = None if cfg.admit_ratio is None else self.predict(streams + 1)
        return t is None or t <= cfg.admit_ratio * cfg.frame_s


class Pacer:
    """Which streams the talker skips this step."""

    def __init__(self, cfg: PacingConfig) -> None:
        self.cfg = cfg
        self.paused: set[int] = set()

    def saturated(self, loop_s: float) -> bool:
        return loop_s > self.cfg.saturated_ratio * self.cfg.frame_s

    def plan(self, now: float, clocks: dict[int, PlaybackClock], loop_s: float, idle: bool = False,
             held: set[int] | frozenset[int] = frozenset()) -> tuple[list[int], list[int], float | None]:
        """(stream ids to pause, to resume, seconds until the first paused one must resume).

        `idle`: the talker has nothing to run but paused streams; then the GPU is not saturated
        whatever the last loop time was (no step has run since), and everyone resumes. A stream is
        paused only while some unpaused stream is not far ahead (waiting for first audio counts):
        pausing when every stream is far ahead frees the GPU for nobody. While some stream waits for
        its first audio and at most `yield_max_streams` others exist, streams above `yield_ahead_s` stay
        paused too (idle or not: the newcomer runs). `held` streams wait for their clients to take their
        audio (`StreamHandle._hold`): paused whatever the load, resumed only once no longer held."""
        cfg = self.cfg
        saturated = self.saturated(loop_s) and not idle
        aheads = {sid: clock.ahead_s(now) for sid, clock in clocks.items()}
        needy = any(a <= cfg.pause_ahead_s for sid, a in aheads.items() if sid not in self.paused and sid not in held)
        waiting = sum(a == -math.inf for a in aheads.values())
        yielding = cfg.yield_ahead_s is not None and 0 < waiting and len(aheads) - waiting <= cfg.yield_max_streams
        pause, resume, wake = [], [], None
        for sid, ahead in aheads.items():
            if sid in held:
                if sid not in self.paused:
                    pause.append(sid)
                continue
            yields = yielding and ahead > cfg.yield_ahead_s
            paced = saturated and ahead > cfg.resume_ahead_s
            if sid in self.paused and not (yields or paced):
                resume.append(sid)
                continue
            if sid not in self.paused:
                if not (yields or (saturated and needy and ahead > cfg.pause_ahead_s)):
                    continue
                pause.append(sid)
            left = ahead - max(cfg.resume_ahead_s if paced else -math.inf, cfg.yield_ahead_s if yields else -math.inf)
            wake = left if wake is None else min(wake, left)
        self.paused.difference_update(resume)
        self.paused.update(pause)
        return pause, resume, wake

    def forget(self, sid: int) -> None:
        self.paused.discard(sid)
