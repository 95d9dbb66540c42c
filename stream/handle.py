"""One context's side of the pipeline, on the event loop: `StreamHandle` takes its text, submits
its segments to the engine one after another (with the context's voice and, without a reference,
the audio of its previous segments as history), queues each segment's audio in a bounded queue for
its transport, and ends with exactly one `End` after all its `Audio`. `_Segment` is one engine
request: its adapter and playback clock belong to the engine thread once submitted.

The handle only calls its pipeline (`stream/pipeline.py`) through a few methods (`_submit`,
`_cancel`, `_encode`, `_release`, `adapter_config`) and reads `cfg`, `metrics` and `now()`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from higgs_stream.engine.errors import CancelledStream, HiggsStreamError
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
from higgs_stream.stream.adapter import Code2WavAdapter
from higgs_stream.stream.config import SAMPLE_RATE
from higgs_stream.stream.errors import SlowClientError
from higgs_stream.stream.messages import ContextOptions
from higgs_stream.stream.metrics import UnderrunMeter
from higgs_stream.stream.pacing import PlaybackClock
from higgs_stream.stream.voices import Voice

if TYPE_CHECKING:
    from higgs_stream.stream.pipeline import Pipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Audio:
    pcm: bytes  # s16le mono 24 kHz


@dataclass(frozen=True)
class End:
    reason: str  # completed | cancelled | disconnected (its client went: no `done` is sent) | error
    error: HiggsStreamError | None = None


Event = Audio | End


@dataclass(eq=False)
class _Segment:
    """One engine request. `frames`/`adapter` belong to the engine thread after submission."""

    handle: StreamHandle
    index: int
    text: str
    request: GenerationRequest
    adapter: Code2WavAdapter
    keep_frames: bool
    submitted_at: float
    sid: int = -1
    frames: list[np.ndarray] = field(default_factory=list)
    started: bool = False
    framed: bool = False  # engine thread, while tracing: its first frame came
    meter: UnderrunMeter = field(default_factory=lambda: UnderrunMeter(SAMPLE_RATE))
    clock: PlaybackClock = field(default_factory=PlaybackClock)  # engine thread: audio planned vs wall time
    held: bool = False  # paused for its client (event loop sets, engine thread reads: `Pipeline._hold`)


def generation_request(opts: ContextOptions, text: str, index: int, max_frames: int, reference=None,
                       history: tuple = ()) -> GenerationRequest:
    """The engine request for segment `index` of a context with `opts` (its seed stepped per segment)."""
    seed = None if opts.seed is None else (opts.seed + index) % 2**63
    return GenerationRequest(
        text=text, reference=reference, scene=opts.scene, instructions=opts.instructions, speaker=opts.voice.speaker,
        history=history, sampling=SamplingParams(temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p,
                                                 seed=seed),
        max_frames=max_frames,
    )


class StreamHandle:
    """One context: say() segments, close() when no more text, cancel() to stop; read with
    `take()` (non-blocking) or `next()`. Exactly one End is queued, after all its Audio."""

    def __init__(self, pipeline: Pipeline, options: ContextOptions, transport: str, stream_id: str):
        self.pipeline = pipeline
        self.options = options
        self.transport = transport
        self.stream_id = stream_id  # the context id (WS, WebRTC) or a request id (HTTP): for the access log
        self.said_at: float | None = None  # first text (event loop clock)
        self.first_audio_at: float | None = None  # first audio queued
        self.finished = False  # End queued
        self._accounted = False  # its outcome counted (`_account`)
        self.samples = 0  # samples queued so far
        self._queue: deque[Event] = deque()
        self._buffered = 0  # samples in the queue
        self.held = False  # generation paused: stream_hold_s of audio waits for the client (until half is left)
        self._taken = False  # the client took some audio (only then can it be slow: a queued context waits its turn)
        self._stall = None  # the slow_client timer while held
        self._texts: deque[str] = deque()
        self._closed = False
        self._segment: _Segment | None = None
        self._index = 0
        self._history: deque[Reference] = deque()
        self._reference: Reference | None = None
        self._encoding = False
        self._waker = None
        self._ready = asyncio.Event()
        self.active_at = pipeline.now()  # last text, audio or segment end (transports' idle clocks)

    # ---- control (event loop) ----

    def say(self, *texts: str) -> None:
        """Queue text segments (an HTTP request's all at once: the first segment's start checks them together)."""
        assert not self._closed, "say() after close()"
        if self.finished:
            return
        self._texts.extend(texts)
        self.active_at = self.pipeline.now()
        if self.said_at is None:
            self.said_at = self.active_at
        self._pump()

    def close(self) -> None:
        """No more text: End("completed") follows the last segment's audio."""
        self._closed = True
        self._pump()

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop now, its queued audio dropped; `reason` "disconnected" when its client went away (closed, reset, dropped
        by the keepalive) rather than asked (metrics' outcome and the access log tell the two apart). After its
        last segment, while its End still waits behind audio the client has not taken, it is counted with `reason`
        instead of `completed` (the audio never left)."""
        assert reason in ("cancelled", "disconnected"), reason
        if self.finished:
            if not self._accounted:
                self._drop_queue()
                self._ready.clear()  # nothing left to take
                self._account(End(reason))
            return
        self._stop(End(reason))

    @property
    def busy(self) -> bool:
        """The pipeline has work for this context: a segment generating, text or a reference waiting."""
        return not self.finished and (self._segment is not None or bool(self._texts) or self._encoding)

    def set_waker(self, waker) -> None:
        """`waker()` is called whenever an event is queued."""
        self._waker = waker

    # ---- reading (event loop) ----

    def take(self, max_bytes: int, first_alone: bool = False, defer_completed: bool = False) -> list[Event]:
        """Queued events without waiting: consecutive Audio merged up to `max_bytes` (at least one
        chunk; only one when `first_alone`), or the End when it is next: never with audio, so a stream is counted
        when its transport, having sent all its audio, comes back for its End (a probe: one counted `completed`
        with its last second still in the process when its client left). `defer_completed`: a transport that
        plays audio out after taking it (WebRTC's track, seconds ahead) counts a `completed` End itself, with
        `delivered()` once it has played, or `cancel(reason)` when it will not."""
        out: list[Event] = []
        if self._queue and isinstance(self._queue[0], Audio):
            parts = [self._queue.popleft().pcm]
            size = len(parts[0])
            while (not first_alone and self._queue and isinstance(self._queue[0], Audio)
                   and size + len(self._queue[0].pcm) <= max_bytes):
                parts.append(self._queue.popleft().pcm)
                size += len(parts[-1])
            self._buffered -= size // 2
            out.append(Audio(b"".join(parts)))
            self._taken = True
            if self.held:
                if self._buffered <= self.pipeline.cfg.stream_hold_samples // 2:
                    self._hold(False)
                elif self._stall is None:
                    self._arm_stall()
        if self._queue and isinstance(self._queue[0], End) and not out:  # alone: after the transport sent the audio
            out.append(self._queue.popleft())
            if not (defer_completed and out[-1].reason == "completed"):
                self._account(out[-1])
        if not self._queue:
            self._ready.clear()
        return out

    def delivered(self) -> None:
        """The transport played a `completed` End it took with `defer_completed`: counted now."""
        assert self.finished, "delivered() before the End was taken"
        self._account(End("completed"))

    async def next(self, max_bytes: int, first_alone: bool = False) -> list[Event]:
        while not self._queue:
            await self._ready.wait()
        return self.take(max_bytes, first_alone)

    # ---- segment flow (event loop) ----

    def _pump(self) -> None:
        """Submit the next segment when none is in flight and the client is not held up; End when all text is
        spoken."""
        if self.finished or self._segment is not None:
            return
        if not self._texts:
            if self._closed:
                self._finish(End("completed"))
            return
        if self.held:
            return  # the next segment waits until the client has taken its audio (`take` resumes)
        voice: Voice = self.options.voice
        if voice.has_reference and self._reference is None:
            if not self._encoding:
                self._encoding = True
                self.pipeline._encode(voice).add_done_callback(self._encoded)
            return
        cfg = self.pipeline.cfg
        whole = " ".join(self._texts) if self._index == 0 and len(self._texts) > 1 else None
        text = self._texts.popleft()
        history = self._reference is None and self.pipeline.takes_history  # earlier segments' audio as context
        try:
            if whole is not None:  # every text said so far checked before the first segment runs: an HTTP request's
                # whole input, before its headers (a control token in a late sentence streamed 33 s of audio, then a
                # truncated body: a probe); the reference, if any, is the real one
                self.pipeline.engine.check(generation_request(self.options, whole, 0, cfg.max_frames, self._reference))
            request = generation_request(self.options, text, self._index, cfg.max_frames, self._reference,
                                         tuple(self._history) if history else ())
            seg = _Segment(
                handle=self, index=self._index, text=text, request=request,
                adapter=Code2WavAdapter(self.pipeline.geometry, self.pipeline.adapter_config(self.options.mode)),
                keep_frames=history and cfg.history_segments > 0,
                submitted_at=self.pipeline.now(),
            )
            self.pipeline._submit(seg)
        except HiggsStreamError as e:
            self.fail(e)
            return
        except Exception as e:  # a bug: this context ends with `internal`, the others go on
            log.exception("submitting segment %d failed", self._index)
            self.fail(HiggsStreamError(f"internal error: {type(e).__name__}"))
            return
        self._segment = seg
        self._index += 1

    def _encoded(self, fut: asyncio.Future) -> None:
        self._encoding = False
        if self.finished:
            return
        if fut.cancelled():
            self.fail(HiggsStreamError("reference encoding was cancelled"))
            return
        exc = fut.exception()
        if exc is not None:
            self.fail(exc if isinstance(exc, HiggsStreamError) else HiggsStreamError(f"encoding failed: {exc!r}"))
            return
        self._reference = fut.result()
        self._pump()

    def _audio(self, seg: _Segment, pcm: bytes, now: float) -> None:
        metrics = self.pipeline.metrics
        if not seg.started:
            seg.started = True
            metrics.ttfa.observe(now - seg.submitted_at)
        samples = len(pcm) // 2
        if seg.meter.chunk(now, samples):
            metrics.underruns.inc()
        metrics.audio_seconds.inc(samples / SAMPLE_RATE)
        if self.first_audio_at is None:
            self.first_audio_at = now
        self._queue.append(Audio(pcm))
        self._buffered += samples
        self.samples += samples
        self.active_at = now
        cfg = self.pipeline.cfg
        if self._buffered > cfg.stream_buffer_samples:
            self._slow(f"client is {self._buffered / SAMPLE_RATE:.1f} s of audio behind "
                       f"(limit {cfg.stream_buffer_s:g} s)")
            return
        if not self.held and self._buffered > cfg.stream_hold_samples:
            self._hold(True)
        self._notify()

    # ---- back-pressure (event loop) ----

    def _hold(self, on: bool) -> None:
        """Pause (on) or resume this context's generation for its client (`stream_hold_s`)."""
        if self._segment is not None:
            self.pipeline._hold(self._segment, on)
        if on:
            self.held = True
            if self._taken:
                self._arm_stall()
            return
        self._unhold()
        self._pump()

    def _arm_stall(self) -> None:
        self._stall = asyncio.get_running_loop().call_later(self.pipeline.cfg.slow_client_s, self._stalled)

    def _stalled(self) -> None:
        self._stall = None
        if self.held and not self.finished:
            self._slow(f"client took too little audio for {self.pipeline.cfg.slow_client_s:g} s "
                       f"({self._buffered / SAMPLE_RATE:.1f} s waiting for it)")

    def _slow(self, message: str) -> None:
        self.pipeline.metrics.slow_clients.inc()
        self.fail(SlowClientError(message))

    def _segment_end(self, seg: _Segment, reason: str, error: str | None, frames: np.ndarray | None) -> None:
        self._segment = None
        self.active_at = self.pipeline.now()
        self.pipeline.metrics.engine_streams.dec()
        if reason in ("stop", "length"):
            if seg.keep_frames and frames is not None and frames.shape[1] > 0:
                self._remember(Reference(codes=frames, transcript=seg.text))
            self._pump()
        elif reason == "cancelled":  # not by us (we drop stale segments): the engine gave up on it
            self.fail(CancelledStream(f"segment {seg.index} was cancelled by the engine"))
        else:
            self.fail(HiggsStreamError(f"generation failed: {error}"))

    def _remember(self, segment: Reference) -> None:
        cfg = self.pipeline.cfg
        self._history.append(segment)
        while len(self._history) > cfg.history_segments:
            self._history.popleft()
        while len(self._history) > 1 and sum(h.num_frames for h in self._history) > cfg.history_max_frames:
            self._history.popleft()

    # ---- endings ----

    def fail(self, error: HiggsStreamError) -> None:
        """End the stream with `error` now (its audio not yet taken is dropped); nothing once it has ended."""
        if self.finished:
            return
        if type(error) is HiggsStreamError:
            log.error("stream failed: %s", error)
        self._stop(End("error", error))

    def _stop(self, end: End) -> None:
        """End now (not yet ended): the engine stream cancelled, the queue dropped; counted at once."""
        self._stop_engine()
        self._drop_queue()
        self._finish(end)
        self._account(end)

    def _drop_queue(self) -> None:
        self._queue.clear()
        self._buffered = 0
        self._unhold()

    def _unhold(self) -> None:
        """Not held, no slow_client timer left (resumed, or ended: its engine stream is gone)."""
        self.held = False
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stop_engine(self) -> None:
        seg = self._segment
        if seg is not None:
            self._segment = None
            self.pipeline.metrics.engine_streams.dec()
            self.pipeline._cancel(seg)

    def _finish(self, end: End) -> None:
        """End queued: its engine work is over (`Pipeline._release`). A stream that ran to its end is counted when
        its client takes the End (`take`), after the last of its audio; one stopped is counted at once (`_stop`)."""
        self.finished = True
        self._queue.append(end)
        self.pipeline._release(self)
        self._notify()

    def _account(self, end: End) -> None:
        """Count the stream's outcome once (metrics, the access log, the trace)."""
        if not self._accounted:
            self._accounted = True
            self.pipeline._account(self, end.reason, None if end.error is None else end.error.code)

    def _notify(self) -> None:
        self._ready.set()
        if self._waker is not None:
            self._waker()
