"""The asyncio pipeline: one engine thread steps every stream, one adapter per segment turns its
codec frames into decode jobs, one codec thread runs them (one stateful step for every due
stream), and each stream's audio waits in a bounded queue for its transport (`stream/handle.py`).

    event loop                          engine thread (one)                codec thread (one)
    ----------                          -------------------                ------------------
    Pipeline.open() -> StreamHandle     loop: engine.step()                loop: take rounds
    handle.say(text) -> engine.add()          route frames -> adapters           one batched decode
    handle.cancel()  -> engine.cancel()       a Round of decode jobs + ends      s16le for all chunks
    _deliver(): bounded queue per handle      -> bounded round queue ------>     call_soon_threadsafe

The engine thread never waits for codec work unless `codec_queue_rounds` rounds are already
queued (back-pressure when the codec is the bottleneck). The codec thread (stream/codec_worker.py)
merges queued rounds into one batched decode call and hands the audio and segment ends to the
event loop in one call, in round order, so each stream's chunks and its end keep their order. On
CUDA the talker steps on a high-priority stream; the codec decodes on its own low-priority stream
(`codec_stream="separate"`) or on the talker's (`"engine"`). Codec calls use bucketed shapes,
warmed up by `Pipeline.start()`.

The engine thread also paces: before each step it pauses streams far ahead of their listener
while the GPU is saturated and resumes them in time (`stream/pacing.py`), and `open()` refuses a
stream (`busy`) when the measured step time says one more would slow everyone below 2x real time.

A StreamHandle (`stream/handle.py`) is one context (or one HTTP request): its text segments are
generated one after another with one voice. Segments of a context without a reference voice are conditioned on the
audio of the context's previous segments (bounded history). Admission is decided at `open()`
(CapacityError at once); a handle whose client does not take its audio pauses its engine stream (`_hold`,
whatever the load) and, held `slow_client_s` after its client took some, ends with `slow_client`; `cancel()` stops the
engine stream before its next step.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from higgs_stream.engine.errors import (
    CapacityError,
    HiggsStreamError,
    InvalidInputError,
)
from higgs_stream.engine.request import Reference
from higgs_stream.stream.adapter import (
    PushJob,
    WindowJob,
    feed_frames,
)
from higgs_stream.stream.chunking import AdapterConfig, handover_steps, loaded_config
from higgs_stream.stream.codec_worker import (
    CodecWorker,
    Round,
    cuda_device,
    on_stream,
)
from higgs_stream.stream.config import FAMILY_FIELDS, SAMPLE_RATE, ServerConfig, for_family
from higgs_stream.stream.errors import ShuttingDownError
from higgs_stream.stream.messages import ContextOptions
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.pacing import LoopModel, Pacer, PacingConfig, relaxed
from higgs_stream.stream.serving_watch import ServingWatch
from higgs_stream.stream.voices import Voice

log = logging.getLogger(__name__)
# One INFO line per finished stream: transport, id, reason, samples generated, ms from first text to first audio.
access_log = logging.getLogger("higgs_stream.access")

class WarmUpError(HiggsStreamError):
    """The warm-up utterance hit an internal error: the model cannot serve (`serve` exits with it)."""

    code = "warm_up_failed"


WARM_UP_TIMEOUT_S = 600.0  # Pipeline.warm_up: first-use kernel compilation can take minutes
DEFAULT_SCHEDULE = AdapterConfig().schedule  # chunk sizes (frames) when the server is idle
DEFAULT_LAST = DEFAULT_SCHEDULE[-1]  # the steady chunk every plan grows to
JITTER_FACTOR = 3.0  # first chunk >= this many (engine loop + codec call) times of audio
DOWNLOADS = ("http",)  # transports whose client may not play in real time: never stepped synchronously for others
PACE_EVERY_S = 0.01  # engine thread: how often the playback clocks are checked (pause/resume)
IDLE_WAIT_S = 0.5  # engine thread: longest sleep without work (it is woken on every add/cancel)
MAX_STEP_FAILURES = 3  # consecutive failed steps after which the pipeline reports unhealthy
ENCODE_FUTURES = 64  # reference encodings remembered (the codec caches codes too)
STOP_GRACE_S = 5.0  # stop(): how long the engine thread may keep stepping to apply the cancels


from higgs_stream.stream.handle import End, StreamHandle, _Segment


class Pipeline:
    def __init__(self, engine, codec, cfg: ServerConfig, metrics: Metrics | None = None, warm_codec: bool = True,
                 codec_graphs: bool = True, codec_stream: str = "separate"):
        """GPU codec: `warm_codec` decodes every bucketed shape once at start, `codec_graphs` then
        captures those up to CODEC_GRAPH_MAX_BATCH windows; `codec_stream` "separate" decodes on a
        low-priority stream beside the talker, "engine" on the talker's stream (the device runs them
        one after the other; the host work still overlaps)."""
        arch = getattr(getattr(engine, "family", None), "arch", None)
        cfg = for_family(cfg, arch)  # the family's defaults filled in
        # what the family's defaults and the flags made of the per-family settings
        log.info("serving %s with %s, codec_starting_ahead_s=%s, codec_queue_rounds=%d, codec_max_windows=%d",
                 arch or "an unnamed family", ", ".join(f"{k}={getattr(cfg, k)}" for k in FAMILY_FIELDS),
                 cfg.codec_starting_ahead_s, cfg.codec_queue_rounds, cfg.codec_max_windows)
        self.codec_worker = CodecWorker(codec, lambda sid: self.engine.cancel(sid), self._deliver,
                                        warm=warm_codec, graphs=codec_graphs, stream_mode=codec_stream,
                                        max_windows=cfg.codec_max_windows, calm_windows=cfg.codec_calm_windows,
                                        max_streams=cfg.max_streams,
                                        busy=self._starting if cfg.codec_schedule == "just_in_time" else lambda: False,
                                        codec_sms=cfg.codec_sms, overdue_first=cfg.codec_overdue_first,
                                        starting=self._starting if cfg.codec_starting_ahead_s is None else self._ramping,
                                        starting_s=None if cfg.codec_starting_ms is None else cfg.codec_starting_ms / 1e3,
                                        starting_exempt_s=cfg.codec_starting_exempt_s,
                                        memory_headroom_gb=cfg.gpu_headroom_gb, queue_rounds=cfg.codec_queue_rounds,
                                        # every low-latency plan `adapter_config` can make: their windows are warmed
                                        ramp_configs=[loaded_config("low_latency", f, cfg.ramp_repeat, DEFAULT_LAST)
                                                      for f in range(1, cfg.max_first_chunk + 1)])
        self.codec_worker.on_call = self._codec_called
        self.engine, self.codec, self.cfg = engine, codec, cfg
        self.geometry = codec.geometry
        self.takes_history = engine.policy.takes_history  # segments of a context conditioned on the earlier ones
        self.pacing = PacingConfig(frame_s=self.geometry.frame_seconds, pause_ahead_s=cfg.pause_ahead_s,
                                   resume_ahead_s=cfg.resume_ahead_s, admit_ratio=cfg.admit_step_ratio,
                                   saturated_ratio=cfg.saturated_step_ratio, yield_ahead_s=cfg.yield_ahead_s)
        self.loop_model = LoopModel()  # engine loop seconds per step vs decode rows (engine thread writes)
        self.pacer = Pacer(self.pacing)
        self._paced_at = 0.0
        self._relaxed = False  # every stream far ahead, none waiting: steps run synchronously (`_pace`)
        self.max_paused = 0  # most streams paused at once (benchmarks read it)
        self.metrics = metrics or Metrics()
        self._handles: set[StreamHandle] = set()
        self.draining = False  # shutting down: open() refuses (stream/driver.py: drain)
        self._segments: dict[int, _Segment] = {}  # engine stream id -> segment (guarded by _lock)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._stop_by = 0.0
        self._thread: threading.Thread | None = None
        self.watch = ServingWatch(self)  # garbage collections and kernel builds (stream/serving_watch.py)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._encoder = ThreadPoolExecutor(1, thread_name_prefix="higgs-encode")
        self._encodes: dict[str, asyncio.Future] = {}
        self._failures = 0
        self.steps = 0
        # benchmarks, serve --trace-out: ("step", t0, t_step, t_end, rows, device wait s, prefills, late prompt
        # launches, synchronous), ("frame0", t, first text) per segment's first frame and ("stream", first
        # text, first audio, end, samples) per released stream
        self.trace: list[tuple] | None = None
        self._engine_stream = None
        self.engine_device = cuda_device(getattr(engine, "device", None))

    # ---- the codec worker's state, read by benches and tests ----

    @property
    def decoder(self):
        """What the ramp windows decode with: CodecGraphs after a GPU warm-up, else the codec."""
        return self.codec_worker.window_graphs or self.codec

    @property
    def codec_calls(self) -> int:
        return self.codec_worker.calls

    @property
    def codec_busy_s(self) -> float:
        """Codec thread time in decode + s16 conversion."""
        return self.codec_worker.busy_s

    # ---- lifecycle ----

    async def start(self) -> None:
        assert self._thread is None, "pipeline already started"
        self._loop = asyncio.get_running_loop()
        # Three threads share the GIL (event loop, engine, codec): process-wide, this is the serving process
        sys.setswitchinterval(self.cfg.gil_switch_s)
        self.watch.watch_builds()  # the codec's warm-up builds kernels too
        try:
            if self.engine_device is not None:
                self._engine_stream = torch.cuda.Stream(self.engine_device, priority=-1)  # talker kernels first
            await self.codec_worker.start(self._engine_stream)
        except BaseException:  # a start that failed leaves no hook behind
            self.watch.close()
            raise
        self.metrics.gpu_memory_cap.set(self.codec_worker.memory_cap or 0)
        self._count_pages()
        self.watch.watch_collections()
        self._thread = threading.Thread(target=self._run, name="higgs-engine", daemon=True)
        self._thread.start()

    def mark_serving(self) -> None:
        """Start-up is over (warm-up run, start-up's objects frozen, the port about to open): the watches say so
        (`ServingWatch.mark_serving`)."""
        self.watch.mark_serving()

    async def warm_up(self, voice: Voice, timeout_s: float = WARM_UP_TIMEOUT_S) -> float | None:
        """One short utterance through every stage (prompt prefill, decode steps, codec, PCM) before a
        server reports healthy, so first-use costs (kernel compilation, autotuning, allocator growth) land
        here and not on the first client: a served Qwen3-TTS checkpoint's first request waited 22 s on an
        H100. The loop model and the codec's call statistics then start afresh: those slow steps must not make
        admission refuse, nor those slow calls size the first requests' first chunks.
        Returns the seconds it took, or None when it failed (logged; the server serves anyway)."""
        t0 = time.perf_counter()
        served, self.metrics = self.metrics, Metrics()  # not a request: its counts and TTFA go nowhere
        try:
            handle = self.open(ContextOptions(voice=voice, seed=0), transport="warm-up")
            handle.say("Hello there.")
            handle.close()
            async with asyncio.timeout(timeout_s):
                while not (end := next((ev for ev in await handle.next(1 << 20) if isinstance(ev, End)), None)):
                    pass
            if end.error is not None:  # it ended, but failed (it was logged as warmed up, a probe)
                raise end.error
        except Exception as exc:  # a warm-up that fails must not keep the server down: it says why
            if getattr(exc, "code", None) == "internal":  # but the model itself failed (non-finite logits, ...):
                raise WarmUpError(f"the warm-up utterance failed: {exc}") from exc  # no request would get audio
            log.warning("warm-up utterance failed (%s: %s); serving anyway", type(exc).__name__, exc)
            return None
        finally:
            self.metrics = served
            self.loop_model = LoopModel()  # the engine thread picks the new one up at its next step
            self.codec_worker.forget_calls()
        seconds = time.perf_counter() - t0
        log.info("warmed up with one utterance in %.1f s", seconds)
        return seconds

    async def stop(self) -> None:
        """Cancel every stream, let the engine thread apply the cancels (freeing their pages), stop it."""
        for handle in list(self._handles):
            handle.cancel()
        self._stop_by = time.monotonic() + STOP_GRACE_S
        self._stopping = True
        self._wake.set()
        try:
            if self._thread is not None:
                await asyncio.to_thread(self._thread.join)
            await self.codec_worker.stop(STOP_GRACE_S)
        finally:
            self.watch.close()
            self._encoder.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self.codec_worker.alive
                and self._failures < MAX_STEP_FAILURES)

    @property
    def active(self) -> int:
        return len(self._handles)

    def now(self) -> float:
        return self._loop.time()

    def adapter_config(self, mode: str) -> AdapterConfig:
        """A new segment's chunk plan. Its first chunk must outlast the delivery jitter of the chunks after it (a
        listener plays chunk 0 at once), so under load it starts with more frames, the larger of two needs, the loop
        time being the larger of the recent one and the one predicted at the current number of streams (a burst is
        loaded from its first arrival):
        - ceil(JITTER_FACTOR x (engine loop + mean codec call) / frame);
        - chunk 1 (`ramp_repeat` 1: twice chunk 0's frames; 2 or more: as many) may wait for the longest
          codec call in flight while chunk 0 waited for none: f frames of audio must cover chunk 1's
          engine steps (2f or f) plus that call, so f >= margin x peak call / (frame - (2 or 1) x loop)
          (`max_first_chunk` when a frame cannot cover them). `first_chunk_margin` covers calls longer than any
          recent one: in a burst of arrivals the backlog's calls ran 2-4x the recent peak. Both per family
          (config.FAMILY_DEFAULTS) unless the config sets them.
        1 when idle; `ramp_repeat` chunks of that size, then doubling to DEFAULT_LAST
        (`chunking.loaded_config`); never above the config's `max_first_chunk`. Sizes are fixed per segment: a
        schedule never shrinks. Low-latency mode keeps its whole ramp of windows while the exact plan would start
        with 1 frame; above that its first chunk alone is a window (LOADED_RAMP's holdback h) and chunk 1 comes from
        the stateful decoder, look-ahead L frames after its last frame instead of h: chunk 1 waits L - h more
        steps, which its first chunk covers too (without that a 1-frame first chunk ran dry at 128 streams, H200)."""
        loop_s = max(self.loop_model.last_s, self.loop_model.predict(len(self._handles)) or 0.0)
        repeat = self.cfg.ramp_repeat
        first = self._first_chunk(loop_s, repeat, 0)
        if mode != "exact" and first > 1:  # under load: chunk 1 waits `handover_steps` more (none on a causal codec)
            first = self._first_chunk(loop_s, repeat,
                                      handover_steps(loaded_config(mode, first, repeat, DEFAULT_LAST), self.geometry))
        return loaded_config(mode, first, repeat, DEFAULT_LAST)

    def _first_chunk(self, loop_s: float, repeat: int, extra_steps: int) -> int:
        """Frames of a first chunk under an engine loop of `loop_s` whose chunk 1 also waits `extra_steps` steps
        (`adapter_config`), within 1..max_first_chunk."""
        frame_s, worker = self.geometry.frame_seconds, self.codec_worker
        first = math.ceil(JITTER_FACTOR * (loop_s + worker.call_s) / frame_s)
        if worker.call_peak_s > 0:  # inf (then the cap) when a frame cannot cover chunk 1's steps
            first = max(first, frames_to_cover(self.cfg.first_chunk_margin * worker.call_peak_s, loop_s, frame_s,
                                               repeat, extra_steps))
        return min(self.cfg.max_first_chunk, max(DEFAULT_SCHEDULE[0], first))

    # ---- admission (event loop) ----

    def open(self, options: ContextOptions, transport: str = "ws", stream_id: str | None = None) -> StreamHandle:
        """Admit one stream; `stream_id` (the context id; a fresh request id when None) names it in
        the access log."""
        if self.draining:
            raise ShuttingDownError("the server is shutting down: it takes no new stream (retry on another one)")
        if not self.healthy:
            raise HiggsStreamError("the engine is not running")
        if len(self._handles) >= self.cfg.max_streams:
            raise CapacityError(f"server is at its limit of {self.cfg.max_streams} streams")
        if not self.loop_model.admits(len(self._handles), self.pacing):
            self.metrics.refused.inc()
            raise CapacityError(f"server is saturated: one more stream would slow every stream below "
                                f"{1 / self.pacing.admit_ratio:g}x real time (step "
                                f"{1e3 * (self.loop_model.predict(len(self._handles) + 1) or 0):.1f} ms predicted)")
        handle = StreamHandle(self, options, transport, stream_id or uuid.uuid4().hex[:16])
        self._handles.add(handle)
        self.metrics.active_streams.set(len(self._handles))
        return handle

    def end_all(self, error: HiggsStreamError) -> int:
        """End every open stream with `error` (its queued audio dropped, its engine stream cancelled): the end of a
        drain (stream/driver.py). Returns how many there were."""
        handles = list(self._handles)
        for handle in handles:
            handle.fail(error)
        return len(handles)

    def _release(self, handle: StreamHandle) -> None:
        """A stream's engine work is over (its End queued): it no longer counts as in flight."""
        self._handles.discard(handle)
        self.metrics.active_streams.set(len(self._handles))

    def _account(self, handle: StreamHandle, reason: str, code: str | None = None) -> None:
        """A stream's outcome (`reason`; `code`: its error's, logged as `reason=error code=...`): when its client took
        its End, or when it was stopped (StreamHandle._account)."""
        self.metrics.requests.inc(transport=handle.transport, outcome=reason)
        ttfa = handle.first_audio_at - handle.said_at if None not in (handle.first_audio_at, handle.said_at) else None
        access_log.info("%s id=%s reason=%s%s samples=%d ttfa_ms=%s", handle.transport, handle.stream_id, reason,
                        "" if code is None else f" code={code}", handle.samples,
                        "-" if ttfa is None else f"{1e3 * ttfa:.0f}")
        if self.trace is not None:  # event-loop clock: time.monotonic, as perf_counter on Linux
            self.trace.append(("stream", handle.said_at, handle.first_audio_at, self.now(), handle.samples))

    def _starting(self) -> bool:
        """Whether some stream waits for its first audio (the codec then decodes just in time)."""
        with self._lock:
            return any(seg.clock.start is None for seg in self._segments.values())

    def _ramping(self) -> bool:
        """Whether some stream waits for its first audio or its listener has less than `codec_starting_ahead_s` of
        audio left (its first chunks, or a listener running dry): the codec's time cap then holds (codec thread)."""
        now, mark = self.now(), self.cfg.codec_starting_ahead_s
        with self._lock:
            return any(seg.clock.ahead_s(now) < mark for seg in self._segments.values())

    def _submit(self, seg: _Segment) -> None:
        with self._lock:  # the engine thread must not see this stream's events before it is mapped
            seg.sid = self.engine.add(seg.request)
            self._segments[seg.sid] = seg
            self._paced_at = 0.0  # pace before the next step: streams far ahead yield to this one's prompt
            self._relaxed = False
        self.metrics.engine_streams.inc()
        self._wake.set()

    def _hold(self, seg: _Segment, on: bool) -> None:
        """Pause (on) or resume a segment's engine stream for its client (`StreamHandle._hold`): the engine thread
        applies it at its next pacing, whatever the load."""
        seg.held = on
        self._paced_at = 0.0
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
        """Decode the reference file (its header was checked on the event loop) and encode it: codes, and
        for a codec that embeds speakers (Qwen3-TTS Base) the x-vector too."""
        wav, sr = voice.decode()  # [T] at 24 kHz
        codes = self.codec.encode(wav, sr, max_seconds=self.cfg.max_reference_s)  # [K, T]
        embedding = None
        if getattr(self.codec, "embeds_speaker", False):
            embedding = self.codec.speaker_embedding(wav, sr, max_seconds=self.cfg.max_reference_s)  # [H]
        return Reference(codes=codes, transcript=voice.transcript, embedding=embedding)

    # ---- engine thread ----

    def _run(self) -> None:
        with on_stream(self._engine_stream):
            self._engine_loop()

    def _engine_loop(self) -> None:
        while True:
            self._wake.clear()
            wake = self._pace()
            if not self.engine.has_work():
                self.loop_model.idle()
                if self._stopping:
                    return
                self._wake.wait(IDLE_WAIT_S if wake is None else min(IDLE_WAIT_S, max(wake, 0.001)))
                continue
            if self._stopping and time.monotonic() > self._stop_by:
                log.error("engine still busy %.0f s after stop; leaving it", STOP_GRACE_S)
                return
            t0 = time.perf_counter()
            wait0 = getattr(self.engine, "wait_s", 0.0)
            late0, sync = self._late_launches(), self._relaxed
            try:
                events = self.engine.step(sync=sync)
                self._failures = 0
            except Exception:
                self._failures += 1
                log.exception("engine step failed (%d in a row)", self._failures)
                time.sleep(min(1.0, 0.05 * self._failures))  # no hot loop on a broken device
                continue  # the failed streams' error events come with the next step
            t_step = time.perf_counter()
            rnd = self._route(events)
            self.steps += 1
            self.metrics.steps.inc()
            self._count_pages()
            self.metrics.step_time.observe(time.perf_counter() - t0)
            t_queue = time.perf_counter()
            if (rnd.jobs or rnd.ends) and not self._queue_round(rnd):
                return
            t_end = time.perf_counter()
            self.loop_model.observe_iteration(len(events), t_end - t0, 2 * self.pacing.frame_s)
            if self.trace is not None:
                self.trace.append(("step", t0, t_step, t_end, len(events), getattr(self.engine, "wait_s", 0.0) - wait0,
                                   getattr(self.engine, "last_prefill", 0), self._late_launches() - late0, sync,
                                   t_end - t_queue))  # the 10th: waiting for room in the codec's queue

    def _late_launches(self) -> int:
        """Prompt launches the engine made while waiting for a step so far (EngineConfig.late_prompts; traces)."""
        return getattr(getattr(self.engine, "runner", None), "late_launches", 0)

    def _pace(self) -> float | None:
        """Pause streams far ahead of their listener while the GPU is saturated, resume them in
        time (every PACE_EVERY_S at most); returns seconds until a paused stream must resume."""
        now = time.monotonic()
        if now - self._paced_at < PACE_EVERY_S:
            return PACE_EVERY_S
        self._paced_at = now
        with self._lock:
            clocks = {sid: seg.clock for sid, seg in self._segments.items()}
            held = {sid for sid, seg in self._segments.items() if seg.held}
        for sid in list(self.pacer.paused):
            if sid not in clocks:
                self.pacer.forget(sid)
        pause, resume, wake = self.pacer.plan(now, clocks, self.loop_model.last_s, idle=not self.engine.has_work(),
                                              held=held)
        self._relaxed = relaxed(now, clocks, self.pacing) and not self._downloading()
        for sid in pause:
            self.engine.pause(sid)
        for sid in resume:
            self.engine.resume(sid)
        self.metrics.paused_streams.set(len(self.pacer.paused))
        self.max_paused = max(self.max_paused, len(self.pacer.paused))
        return wake

    def _downloading(self) -> bool:
        """An HTTP response streams: its client may be downloading, wanting the audio as fast as it is made."""
        with self._lock:
            return any(seg.handle.transport in DOWNLOADS for seg in self._segments.values())

    def _count_pages(self) -> None:
        cache = getattr(self.engine, "cache", None)
        if cache is not None:
            self.metrics.kv_pages_used.set(cache.allocator.num_used)
            self.metrics.kv_pages_free.set(cache.allocator.num_free)
        if self.codec_worker.device is not None:  # the allocator's own count: no device call
            self.metrics.gpu_memory_reserved.set(torch.cuda.memory_reserved(self.codec_worker.device))

    def _queue_round(self, rnd: Round) -> bool:
        """Hand a round to the codec thread, waiting while `codec_queue_rounds` rounds are queued
        (back-pressure). False when stop() gave up waiting for a stuck codec."""
        while not self.codec_worker.submit(rnd, timeout=IDLE_WAIT_S):
            if self._stopping and time.monotonic() > self._stop_by:
                log.error("codec still busy %.0f s after stop; leaving it", STOP_GRACE_S)
                return False
        return True

    def _route(self, events) -> Round:
        """Frames -> adapters -> due decode windows, plus the segments that ended (each after its
        audio: the codec thread delivers a round's audio before its ends)."""
        rnd = Round([], [], [], [])
        now = time.monotonic()
        with self._lock:  # one acquisition per step
            segs = [self._segments.get(ev.stream_id) for ev in events]
            for ev, seg in zip(events, segs):
                if seg is not None and ev.finished:
                    del self._segments[ev.stream_id]
        fed = [i for i, (ev, seg) in enumerate(zip(events, segs)) if seg is not None and ev.frame is not None]
        refused: dict[int, InvalidInputError | None] | None = None  # event index -> its adapter's refusal
        if fed:  # one range check for the whole step; a bad array is fed (and found) per stream below
            finals = [events[i].finished and events[i].reason in ("stop", "length") for i in fed]
            try:
                errors = feed_frames([segs[i].adapter for i in fed], np.stack([events[i].frame for i in fed]), finals)
                refused = dict(zip(fed, errors))
            except (InvalidInputError, ValueError):
                refused = None
        for i, (ev, seg) in enumerate(zip(events, segs)):
            if seg is None:
                continue  # a stream driven by someone else (engine.generate in the same process)
            try:
                ended = ev.finished and ev.reason in ("stop", "length")  # the stream's audio is complete
                if ev.frame is not None:
                    if self.trace is not None and not seg.framed:  # first text (event loop clock) -> first frame
                        seg.framed = True
                        self.trace.append(("frame0", now, seg.handle.said_at))
                    if seg.keep_frames:
                        seg.frames.append(ev.frame)
                    if refused is None:
                        seg.adapter.feed(ev.frame, final=ended)
                    elif refused[i] is not None:
                        raise refused[i]
                elif ended:
                    seg.adapter.close()  # no frame on its last event: nothing more to come
                if ev.frame is not None or ended:
                    jobs = seg.adapter.take_jobs()
                    if jobs:
                        rnd.jobs += jobs
                        rnd.owners += [seg] * len(jobs)
                        seconds = [_job_samples(job, self.geometry.hop) / SAMPLE_RATE for job in jobs]
                        deadline = seg.clock.deadline(now)  # when the listener runs dry without them
                        for s in seconds:
                            rnd.deadlines.append(deadline)
                            deadline = max(deadline, now) + s
                        seg.clock.sent(now, sum(seconds))
                if ended:
                    frames = None
                    if seg.keep_frames:
                        q = self.geometry.num_codebooks
                        frames = np.stack(seg.frames, axis=1) if seg.frames else np.zeros((q, 0), np.int64)
                    rnd.ends.append(("end", seg, ev.reason, None, frames))
                elif ev.finished:
                    rnd.ends.append(("end", seg, ev.reason, ev.error, None))
            except Exception as exc:
                log.exception("routing stream %d failed", ev.stream_id)
                if not ev.finished:
                    self.engine.cancel(ev.stream_id)
                rnd.ends.append(("end", seg, "error", f"adapter failed: {exc!r}", None))
        return rnd

    # ---- codec thread ----

    def _codec_called(self, seconds: float, held_frames: int, late_s: float | None) -> None:
        """After each codec call (codec thread; the metrics are thread-safe): its time, the backlog, and for a call
        holding an overdue job (a first chunk, a dry listener) how late that job was when the call began."""
        self.metrics.codec_call_time.observe(seconds)
        self.metrics.codec_backlog.set(held_frames)
        if late_s is not None:
            self.metrics.codec_overdue_wait.observe(late_s)

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


def frames_to_cover(call_s: float, loop_s: float, frame_s: float, ramp_repeat: int, extra_steps: int = 0) -> float:
    """Frames of audio chunk 0 needs to outlast chunk 1's engine steps (as many frames as chunk 0 with `ramp_repeat`
    above 1, twice as many with 1, plus `extra_steps`) plus a codec call of `call_s`:
    ceil((call + extra x loop) / (frame - m x loop)), each frame leaving frame - m x loop of slack; math.inf when a
    frame cannot cover the steps (`Pipeline.adapter_config`; the offline replay, scripts/replay_first_chunks.py)."""
    spare = frame_s - (1 if ramp_repeat > 1 else 2) * loop_s
    return math.inf if spare <= 0 else math.ceil((call_s + extra_steps * loop_s) / spare)


def _job_samples(job: PushJob | WindowJob, hop: int) -> int:
    """Samples of audio a decode job will deliver."""
    return job.push.emits if isinstance(job, PushJob) else job.new * hop
