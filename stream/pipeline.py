"""The asyncio pipeline: one engine thread steps every stream, one adapter per segment turns its
columns into PCM, and each stream's audio waits in a bounded queue for its transport.

    event loop                          engine thread (one)
    ----------                          -------------------
    Pipeline.open() -> StreamHandle     loop: engine.step()          (one AR step for all streams)
    handle.say(text) -> engine.add()          route columns -> adapters, one batched codec decode
    handle.cancel()  -> engine.cancel()       s16le chunks -> loop.call_soon_threadsafe(_deliver)
    _deliver(): bounded queue per handle

A StreamHandle is one context (or one HTTP request): its text segments are generated one after
another with one voice. Segments of a context without a reference voice are conditioned on the
audio of the context's previous segments (bounded history). Admission is decided at `open()`
(CapacityError at once); a handle whose client falls `stream_buffer_s` behind ends with
`slow_client`; `cancel()` stops the engine stream before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from higgs_stream.engine.delay import columns_to_frames
from higgs_stream.engine.errors import CancelledStream, CapacityError, HiggsStreamError
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
from higgs_stream.stream.adapter import Code2WavAdapter, DecodeJob, decode_jobs, to_s16le
from higgs_stream.stream.config import SAMPLE_RATE, ServerConfig
from higgs_stream.stream.errors import SlowClientError
from higgs_stream.stream.metrics import Metrics, UnderrunMeter
from higgs_stream.stream.session import ContextOptions
from higgs_stream.stream.voices import Voice

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # engine thread: longest sleep without work (it is woken on every add/cancel)
MAX_STEP_FAILURES = 3  # consecutive failed steps after which the pipeline reports unhealthy
ENCODE_FUTURES = 64  # reference encodings remembered (the codec caches codes too)
STOP_GRACE_S = 5.0  # stop(): how long the engine thread may keep stepping to apply the cancels


@dataclass(frozen=True)
class Audio:
    pcm: bytes  # s16le mono 24 kHz


@dataclass(frozen=True)
class End:
    reason: str  # completed | cancelled | error
    error: HiggsStreamError | None = None


Event = Audio | End


@dataclass(eq=False)
class _Segment:
    """One engine request. `columns`/`adapter` belong to the engine thread after submission."""

    handle: StreamHandle
    index: int
    text: str
    request: GenerationRequest
    adapter: Code2WavAdapter
    keep_columns: bool
    submitted_at: float
    sid: int = -1
    columns: list[np.ndarray] = field(default_factory=list)
    started: bool = False
    meter: UnderrunMeter = field(default_factory=lambda: UnderrunMeter(SAMPLE_RATE))


class StreamHandle:
    """One context: say() segments, close() when no more text, cancel() to stop; read with
    `take()` (non-blocking) or `next()`. Exactly one End is queued, after all its Audio."""

    def __init__(self, pipeline: Pipeline, options: ContextOptions, transport: str):
        self.pipeline = pipeline
        self.options = options
        self.transport = transport
        self.finished = False  # End queued
        self.samples = 0  # samples queued so far
        self._queue: deque[Event] = deque()
        self._buffered = 0  # samples in the queue
        self._texts: deque[str] = deque()
        self._closed = False
        self._segment: _Segment | None = None
        self._index = 0
        self._history: deque[Reference] = deque()
        self._reference: Reference | None = None
        self._encoding = False
        self._waker = None
        self._ready = asyncio.Event()

    # ---- control (event loop) ----

    def say(self, text: str) -> None:
        assert not self._closed, "say() after close()"
        if self.finished:
            return
        self._texts.append(text)
        self._pump()

    def close(self) -> None:
        """No more text: End("completed") follows the last segment's audio."""
        self._closed = True
        self._pump()

    def cancel(self) -> None:
        if self.finished:
            return
        self._stop_engine()
        self._queue.clear()
        self._buffered = 0
        self._finish(End("cancelled"))

    def set_waker(self, waker) -> None:
        """`waker()` is called whenever an event is queued."""
        self._waker = waker

    # ---- reading (event loop) ----

    def take(self, max_bytes: int, first_alone: bool = False) -> list[Event]:
        """Queued events without waiting: consecutive Audio merged up to `max_bytes` (at least one
        chunk; only one when `first_alone`), then End if it is next."""
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
        if self._queue and isinstance(self._queue[0], End) and not (out and first_alone):
            out.append(self._queue.popleft())
        if not self._queue:
            self._ready.clear()
        return out

    async def next(self, max_bytes: int, first_alone: bool = False) -> list[Event]:
        while not self._queue:
            await self._ready.wait()
        return self.take(max_bytes, first_alone)

    # ---- segment flow (event loop) ----

    def _pump(self) -> None:
        """Submit the next segment when none is in flight; End when all text is spoken."""
        if self.finished or self._segment is not None:
            return
        if not self._texts:
            if self._closed:
                self._finish(End("completed"))
            return
        voice: Voice = self.options.voice
        if voice.has_reference and self._reference is None:
            if not self._encoding:
                self._encoding = True
                self.pipeline._encode(voice).add_done_callback(self._encoded)
            return
        text = self._texts.popleft()
        opts, cfg = self.options, self.pipeline.cfg
        seed = None if opts.seed is None else (opts.seed + self._index) % 2**63
        try:
            request = GenerationRequest(
                text=text, reference=self._reference, scene=opts.scene,
                history=tuple(self._history) if self._reference is None else (),
                sampling=SamplingParams(temperature=opts.temperature, top_k=opts.top_k, top_p=opts.top_p, seed=seed),
                max_frames=cfg.max_frames,
            )
            seg = _Segment(
                handle=self, index=self._index, text=text, request=request,
                adapter=Code2WavAdapter(self.pipeline.codec, mode=opts.mode),
                keep_columns=self._reference is None and cfg.history_segments > 0,
                submitted_at=self.pipeline.now(),
            )
            self.pipeline._submit(seg)
        except HiggsStreamError as e:
            self._fail(e)
            return
        self._segment = seg
        self._index += 1

    def _encoded(self, fut: asyncio.Future) -> None:
        self._encoding = False
        if self.finished:
            return
        if fut.cancelled():
            self._fail(HiggsStreamError("reference encoding was cancelled"))
            return
        exc = fut.exception()
        if exc is not None:
            self._fail(exc if isinstance(exc, HiggsStreamError) else HiggsStreamError(f"encoding failed: {exc!r}"))
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
        self._queue.append(Audio(pcm))
        self._buffered += samples
        self.samples += samples
        if self._buffered > self.pipeline.cfg.stream_buffer_samples:
            metrics.slow_clients.inc()
            self._fail(SlowClientError(
                f"client is {self._buffered / SAMPLE_RATE:.1f} s of audio behind "
                f"(limit {self.pipeline.cfg.stream_buffer_s:g} s)"))
            return
        self._notify()

    def _segment_end(self, seg: _Segment, reason: str, error: str | None, frames: np.ndarray | None) -> None:
        self._segment = None
        self.pipeline.metrics.engine_streams.dec()
        if reason in ("stop", "length"):
            if seg.keep_columns and frames is not None and frames.shape[1] > 0:
                self._remember(Reference(codes=frames, transcript=seg.text))
            self._pump()
        elif reason == "cancelled":  # not by us (we drop stale segments): the engine gave up on it
            self._fail(CancelledStream(f"segment {seg.index} was cancelled by the engine"))
        else:
            self._fail(HiggsStreamError(f"generation failed: {error}"))

    def _remember(self, segment: Reference) -> None:
        cfg = self.pipeline.cfg
        self._history.append(segment)
        while len(self._history) > cfg.history_segments:
            self._history.popleft()
        while len(self._history) > 1 and sum(h.num_frames for h in self._history) > cfg.history_max_frames:
            self._history.popleft()

    # ---- endings ----

    def _fail(self, error: HiggsStreamError) -> None:
        if self.finished:
            return
        if type(error) is HiggsStreamError:
            log.error("stream failed: %s", error)
        self._stop_engine()
        self._queue.clear()
        self._buffered = 0
        self._finish(End("error", error))

    def _stop_engine(self) -> None:
        seg = self._segment
        if seg is not None:
            self._segment = None
            self.pipeline.metrics.engine_streams.dec()
            self.pipeline._cancel(seg)

    def _finish(self, end: End) -> None:
        self.finished = True
        self._queue.append(end)
        self.pipeline._release(self, end.reason)
        self._notify()

    def _notify(self) -> None:
        self._ready.set()
        if self._waker is not None:
            self._waker()


class Pipeline:
    def __init__(self, engine, codec, cfg: ServerConfig, metrics: Metrics | None = None):
        self.engine, self.codec, self.cfg = engine, codec, cfg
        self.metrics = metrics or Metrics()
        self._handles: set[StreamHandle] = set()
        self._segments: dict[int, _Segment] = {}  # engine stream id -> segment (guarded by _lock)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._stop_by = 0.0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="higgs-encode")
        self._encodes: dict[str, asyncio.Future] = {}
        self._failures = 0
        self.steps = 0

    # ---- lifecycle ----

    async def start(self) -> None:
        assert self._thread is None, "pipeline already started"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="higgs-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Cancel every stream, let the engine thread apply the cancels (freeing their pages), stop it."""
        for handle in list(self._handles):
            handle.cancel()
        self._stop_by = time.monotonic() + STOP_GRACE_S
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._encoder.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self._failures < MAX_STEP_FAILURES)

    @property
    def active(self) -> int:
        return len(self._handles)

    def now(self) -> float:
        return self._loop.time()

    # ---- admission (event loop) ----

    def open(self, options: ContextOptions, transport: str = "ws") -> StreamHandle:
        if not self.healthy:
            raise HiggsStreamError("the engine is not running")
        if len(self._handles) >= self.cfg.max_streams:
            raise CapacityError(f"server is at its limit of {self.cfg.max_streams} streams")
        handle = StreamHandle(self, options, transport)
        self._handles.add(handle)
        self.metrics.active_streams.set(len(self._handles))
        return handle

    def _release(self, handle: StreamHandle, reason: str) -> None:
        self._handles.discard(handle)
        self.metrics.active_streams.set(len(self._handles))
        self.metrics.requests.inc(transport=handle.transport, outcome=reason)

    def _submit(self, seg: _Segment) -> None:
        with self._lock:  # the engine thread must not see this stream's events before it is mapped
            seg.sid = self.engine.add(seg.request)
            self._segments[seg.sid] = seg
        self.metrics.engine_streams.inc()
        self._wake.set()

    def _cancel(self, seg: _Segment) -> None:
        self.engine.cancel(seg.sid)  # the engine frees its pages at the start of its next step
        self._wake.set()

    def _encode(self, voice: Voice) -> asyncio.Future:
        """Reference codes for `voice`, encoded once on the encode thread (shared by handles)."""
        fut = self._encodes.get(voice.key)
        if fut is None:
            fut = self._loop.run_in_executor(self._encoder, self._encode_sync, voice)
            self._encodes[voice.key] = fut
            fut.add_done_callback(lambda f, key=voice.key: self._encoded(key, f))
            while len(self._encodes) > ENCODE_FUTURES:
                self._encodes.pop(next(iter(self._encodes)))
        return fut

    def _encoded(self, key: str, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            self._encodes.pop(key, None)  # do not remember failures

    def _encode_sync(self, voice: Voice) -> Reference:
        codes = self.codec.encode(voice.wav, voice.sample_rate, max_seconds=self.cfg.max_reference_s)
        return Reference(codes=codes, transcript=voice.transcript)  # [8, T]

    # ---- engine thread ----

    def _run(self) -> None:
        while True:
            self._wake.clear()
            if not self.engine.has_work():
                if self._stopping:
                    return
                self._wake.wait(IDLE_WAIT_S)
                continue
            if self._stopping and time.monotonic() > self._stop_by:
                log.error("engine still busy %.0f s after stop; leaving it", STOP_GRACE_S)
                return
            t0 = time.perf_counter()
            try:
                events = self.engine.step()
                self._failures = 0
            except Exception:
                self._failures += 1
                log.exception("engine step failed (%d in a row)", self._failures)
                time.sleep(min(1.0, 0.05 * self._failures))  # no hot loop on a broken device
                continue  # the failed streams' error events come with the next step
            items = self._route(events)
            self.steps += 1
            self.metrics.steps.inc()
            self.metrics.step_time.observe(time.perf_counter() - t0)
            if items:
                self._loop.call_soon_threadsafe(self._deliver, items)

    def _route(self, events) -> list[tuple]:
        """Columns -> adapters -> one batched decode. Returns ("audio", seg, pcm) and
        ("end", seg, reason, error, frames) items, each segment's audio before its end."""
        jobs: list[DecodeJob] = []
        owners: list[_Segment] = []
        ends: list[tuple] = []
        for ev in events:
            with self._lock:
                seg = self._segments.get(ev.stream_id)
                if seg is not None and ev.finished:
                    del self._segments[ev.stream_id]
            if seg is None:
                continue  # a stream driven by someone else (engine.generate in the same process)
            try:
                ended = ev.finished and ev.reason in ("stop", "length")  # through the EOS ramp-out
                if ev.column is not None:
                    if seg.keep_columns:
                        seg.columns.append(ev.column)
                    seg.adapter.feed(ev.column, final=ended)
                    while (job := seg.adapter.take_job()) is not None:
                        jobs.append(job)
                        owners.append(seg)
                if ended:
                    assert ev.column is not None, f"stream {ev.stream_id} ended ({ev.reason}) without its last column"
                    frames = None
                    if seg.keep_columns:
                        frames = columns_to_frames(np.stack(seg.columns, axis=1), codebook_size=self.engine.cfg.codebook_size)
                    ends.append(("end", seg, ev.reason, None, frames))
                elif ev.finished:
                    ends.append(("end", seg, ev.reason, ev.error, None))
            except Exception as exc:
                log.exception("routing stream %d failed", ev.stream_id)
                if not ev.finished:
                    self.engine.cancel(ev.stream_id)
                ends.append(("end", seg, "error", f"adapter failed: {exc!r}", None))
        items: list[tuple] = []
        if jobs:
            try:
                chunks = decode_jobs(self.codec, jobs)
                items = [("audio", seg, to_s16le(chunk)) for seg, chunk in zip(owners, chunks)]
            except Exception as exc:
                log.exception("codec decode of %d windows failed", len(jobs))
                failed = {id(s): s for s in owners}
                ends = [e for e in ends if id(e[1]) not in failed]
                for seg in failed.values():
                    self.engine.cancel(seg.sid)
                    ends.append(("end", seg, "error", f"codec decode failed: {exc!r}", None))
        return items + ends

    # ---- back on the event loop ----

    def _deliver(self, items: list[tuple]) -> None:
        now = self.now()
        for item in items:
            seg = item[1]
            handle = seg.handle
            if handle.finished or handle._segment is not seg:
                continue  # cancelled or failed meanwhile
            if item[0] == "audio":
                handle._audio(seg, item[2], now)
            else:
                handle._segment_end(seg, item[2], item[3], item[4])
