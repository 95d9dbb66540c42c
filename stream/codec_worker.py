"""The codec worker: one thread that turns the engine thread's rounds of decode jobs into audio.

The engine thread hands it one `Round` per step (`submit`, into a bounded queue of
`queue_rounds` rounds, CODEC_QUEUE_ROUNDS by default: back-pressure when the codec is the bottleneck). Every job carries
its deadline: when the stream's listener runs dry without it (monotonic seconds; a first chunk's
deadline is its creation time). While some stream waits for its first audio (`busy()`), the thread
decodes **just in time, in batches**: nothing runs until some job is within `CODEC_URGENT_S` of its
deadline; then one call takes every job due within `CODEC_AHEAD_S`, most urgent first,
`calm_windows` streams per call while the codec keeps up, `max_windows` once it has fallen behind (it
holds more frames than one full call of `max_windows` streams' steady chunks). The talker runs streams
seconds ahead of their listeners while it can, and decoding all of that at once would take the GPU from the talker exactly when new streams
wait for their first audio; just in time, the codec's share of the GPU follows real time. When no
stream is starting, everything held is decoded once the oldest job waited `CODEC_HOLD_S` (or at once
when one is urgent), so a lone request (an HTTP download) gets its audio as fast as it is made. A
segment's end flushes its jobs at once.

Calls run the jobs through one `Code2Wav` (stream/adapter.py): every due stream's new frames in the
stateful decoder's few steps, ramp windows in few one-shot calls. Audio and segment ends reach the
event loop in one `deliver(items)` call per codec call, each stream's chunks and its end in order.
A failed decode ends only the segments in that call (their engine streams are cancelled); the
thread lives on.

On CUDA it decodes on its own low-priority stream (`stream_mode="separate"`) or on the talker's
(`"engine"`: the device then runs them back to back, only the host work overlaps). With
`overdue_first`, a call that holds an overdue job (a stream's first chunk, a listener already dry)
runs on a stream of the device's highest priority instead, above the talker's, so its kernels are
scheduled first while a talker step runs beside it (the talker step needed next is ~80 ms away for a
starting stream; its first chunk is what the listener waits for). The stateful
steps replay from CUDA graphs captured per (streams, frames) bucket by `start()`; ramp windows use
bucketed batches (stream/codec_graphs.py replays them). A CPU codec runs eagerly.

Segments are opaque here: the worker reads `seg.sid` (to cancel a failed one in the engine) and
keys the stateful decoder's slots by the segment object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.gpu_memory import WARMUP_HEADROOM_GB, bound_process_memory, with_plan_headroom
from higgs_stream.stream.adapter import Code2Wav, Job, jobs_to_s16le
from higgs_stream.stream.chunking import AdapterConfig, window_lengths
from higgs_stream.stream.config import CODEC_MAX_WINDOWS  # the most streams one call decodes
from higgs_stream.stream.config import CODEC_QUEUE_ROUNDS  # rounds of decode work queued for the codec thread
from higgs_stream.stream.pacing import LoopModel

log = logging.getLogger(__name__)

# GPU stateful decoder: steps are padded to these (streams, frames) buckets and replayed from CUDA
# graphs; a step outside them runs eagerly. Frame buckets: `frame_buckets()`.
CODEC_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CODEC_WINDOW_BUCKETS = (1, 2, 4, 8, 16)  # low-latency ramp windows: batch buckets (warmed, graphed)

CODEC_STATE_SLOTS_MIN = 64  # stateful decoder slots at least (else 2 x max streams)
# Just-in-time batching: a call runs once some listener would run dry within CODEC_URGENT_S (first
# chunks at once) and takes every job needed within CODEC_AHEAD_S.
CODEC_URGENT_S = 0.3
CODEC_AHEAD_S = 1.0
CODEC_HOLD_S = 0.05  # not busy: a job waits at most this long for others to share its call
# the warm-up's graphs vs native convolutions, max |d| / peak: fp32 rounding is ~1e-6; the opt-in TF32 codec ~1e-3
# (8.5e-4 on the full Higgs decoder, H200); a wrong cuDNN plan was 0.16-0.21 (engine/gpu_memory.py)
NATIVE_TOLERANCE = 1e-3
NATIVE_TOLERANCE_TF32 = 2e-2
CALL_PEAK_HALF_LIFE_S = 1.0  # CodecWorker.call_peak_s forgets a long call this fast
CODEC_STREAMS = ("separate", "engine")  # the codec's CUDA stream: its own (low priority) or the talker's


def batch_buckets(max_windows: int) -> tuple[int, ...]:
    """The stateful decoder's batch buckets a worker warms up and graphs: CODEC_BATCH_BUCKETS up to the smallest that
    holds `max_windows` rows (all of them above the largest). A call decodes at most `max_windows` streams, one row
    each (`_decode_due` cuts even a stop's flush into such calls), so a larger bucket would never be replayed: a
    `--codec-max-windows 32` leaves the 64-row graphs, the largest, uncaptured."""
    out = []
    for b in CODEC_BATCH_BUCKETS:
        out.append(b)
        if b >= max_windows:
            break
    return tuple(out)


@dataclass
class Round:
    """One engine step's output for the codec thread: decode jobs (jobs[i] belongs to owners[i] and
    is needed by deadlines[i]) and the segment ends that must follow their audio."""

    jobs: list[Job]
    owners: list[Any]  # pipeline segments (opaque here; `.sid` is read on a codec failure)
    ends: list[tuple]  # ("end", seg, reason, error, frames)
    deadlines: list[float] = field(default_factory=list)  # monotonic s; missing: due now


@dataclass
class Pending:
    """A job the codec thread holds until it is due."""

    seg: Any
    job: Job
    deadline: float
    taken: float = 0.0  # when the codec thread took it (monotonic s)


def due(pending: list[Pending], now: float, flush: set[int], busy: bool = True) -> list[Pending]:
    """The jobs of the next calls, in deadline order (stable: a segment's jobs keep their order).
    Some job overdue (a first chunk, or a listener already dry): just the jobs within CODEC_URGENT_S
    of their deadline, so a first frame's call is not stretched by other streams' 25-frame steps
    (H100, Qwen3-TTS at 1 request/s: a first frame shared a [2 x 26]-frame call of 20 ms where its own
    takes 7). An ended segment's jobs that are not urgent wait for the next call (its listener has that
    audio's worth of buffer; only its `done` comes one call later): at 20 requests/s a stream ends every
    50 ms, and calls holding a first chunk took 24 frames at the median when over 15 ms (H100 trace,
    Qwen3-TTS 1.7B, 4 s clips: 37 of 171 such calls; p95 27 ms).
    Busy (a stream waits for its first audio): none while no job is within CODEC_URGENT_S of its
    deadline and no segment is in `flush` (ids of ended segments), else every job due within
    CODEC_AHEAD_S plus every job of a flushed segment. Not busy: all of them once one is urgent or
    flushed or the oldest has waited CODEC_HOLD_S."""
    if not pending:
        return []
    urgent = any(p.deadline - now <= CODEC_URGENT_S or id(p.seg) in flush for p in pending)
    if any(p.deadline <= now for p in pending):  # a first chunk (due at its creation) or a dry listener:
        # its call takes only the urgent jobs; the rest (ended segments' too) follow in the next call
        # instead of lengthening this one
        return sorted((p for p in pending if p.deadline - now <= CODEC_URGENT_S), key=lambda p: p.deadline)
    if not busy:
        ready = urgent or now - min(p.taken for p in pending) >= CODEC_HOLD_S
        return sorted(pending, key=lambda p: p.deadline) if ready else []
    if not urgent:
        return []
    take = [p for p in pending if p.deadline - now <= CODEC_AHEAD_S or id(p.seg) in flush]
    return sorted(take, key=lambda p: p.deadline)


def within_cap(take: list[Pending], fits: Callable[[int], bool], now: float,
               exempt_s: float = CODEC_URGENT_S) -> list[Pending]:
    """`take` (deadline order: a segment's jobs keep their order) cut for a call made while a stream waits
    for its first audio (or, with codec_starting_ahead_s, a listener has little audio left): every job due within
    `exempt_s` (CODEC_URGENT_S by default: a listener about to run dry never waits for it), then the next jobs while
    `fits(frames)` holds for the call's codec frames; at least one job (`CodecWorker._fits`: the call's predicted
    time within `codec_starting_ms`). A shorter `exempt_s` (codec_starting_exempt_s) cuts a burst's calls in deadline
    order too: a job due later than that waits for the next call, which starts as this one ends.
    A call costs a fixed ~5 ms plus ~0.5 ms per frame (H100, Qwen3-TTS's 12 Hz decoder: 40-80 frames
    ~28 ms), and the codec thread runs one at a time. Without the urgent jobs' exemption a burst of
    arrivals (someone always starting) held every call to `frames` and the codec fell behind (H100, v2,
    128 streams arriving over 2 s, cap 16: 91 of 256 streams underran vs 0 uncapped)."""
    out, n = [], 0
    for p in take:
        f = p.job.codes.shape[1]
        if out and not fits(n + f) and p.deadline - now > exempt_s:
            break
        out.append(p)
        n += f
    return out


def wake_in(pending: list[Pending], now: float, busy: bool = True, flush: set[int] = frozenset()) -> float | None:
    """Seconds until `due` would take something without a new round (None: nothing held; 0 while an
    ended segment in `flush` still holds jobs, which a first chunk's call left for the next one)."""
    if not pending:
        return None
    if any(id(p.seg) in flush for p in pending):
        return 0.0
    first = min(p.deadline for p in pending) - CODEC_URGENT_S
    if not busy:
        first = min(first, min(p.taken for p in pending) + CODEC_HOLD_S)
    return max(0.0, first - now)


class CodecWorker:
    """Batched decode rounds on their own thread (and CUDA stream). `cancel(sid)` stops a failed
    segment's engine stream; `deliver(items)` runs on the event loop with ("audio", seg, pcm) and
    ("end", seg, reason, error, frames) items in order."""

    def __init__(self, codec, cancel: Callable[[int], None], deliver: Callable[[list[tuple]], None], *,
                 warm: bool = True, graphs: bool = True, stream_mode: str = "separate",
                 max_windows: int = CODEC_MAX_WINDOWS, calm_windows: int | None = None,
                 max_streams: int = CODEC_STATE_SLOTS_MIN // 2,
                 busy: Callable[[], bool] = lambda: False, codec_sms: int | None = None,
                 overdue_first: bool = False, starting: Callable[[], bool] = lambda: False,
                 starting_s: float | None = None, starting_exempt_s: float | None = None,
                 memory_headroom_gb: float | None = None, queue_rounds: int = CODEC_QUEUE_ROUNDS,
                 ramp_configs: Sequence[AdapterConfig] = (AdapterConfig(mode="low_latency"),)):
        if stream_mode not in CODEC_STREAMS:
            raise ConfigError(f"codec_stream must be one of {CODEC_STREAMS}, got {stream_mode!r}")
        if max_windows < 1:
            raise ConfigError(f"codec_max_windows must be >= 1, got {max_windows}")
        if calm_windows is not None and calm_windows < 1:
            raise ConfigError(f"codec_calm_windows must be >= 1 or None, got {calm_windows}")
        if queue_rounds < 1:
            raise ConfigError(f"codec_queue_rounds must be >= 1, got {queue_rounds}")
        if memory_headroom_gb is not None and memory_headroom_gb <= 0:
            raise ConfigError(f"gpu_headroom_gb must be > 0 or None, got {memory_headroom_gb}")
        self.codec = codec
        self.window_graphs = None  # CodecGraphs replaying the ramp windows after a GPU warm-up (Code2Wav uses them)
        self.device = cuda_device(getattr(codec, "device", None))
        self.code2wav = Code2Wav(codec, max_slots=max(CODEC_STATE_SLOTS_MIN, 2 * max_streams),
                                 window_buckets=CODEC_WINDOW_BUCKETS if self.device is not None else None)
        self._cancel, self._deliver = cancel, deliver
        self.stream_mode, self.max_windows, self.busy = stream_mode, max_windows, busy
        # streams a call takes while the codec keeps up: at most `behind_frames` held (one full call of max_windows
        # streams' steady chunks); more, and calls take max_windows (config.py: why, measured)
        self.calm_windows = max_windows if calm_windows is None else min(calm_windows, max_windows)
        self.behind_frames = max_windows * AdapterConfig().schedule[-1]
        if codec_sms is not None and stream_mode != "separate":
            raise ConfigError("codec_sms needs the codec on its own stream (codec_stream='separate')")
        self.codec_sms = codec_sms  # CUDA: decode on a green context of this many SMs (None: every SM)
        if overdue_first and (stream_mode != "separate" or codec_sms is not None):
            raise ConfigError("codec_overdue_first needs the codec on its own stream (codec_stream='separate', "
                              "no codec_sms)")
        self.overdue_first = overdue_first
        if starting_s is not None and starting_s <= 0:
            raise ConfigError(f"codec_starting_ms must be > 0 or None, got {starting_s * 1e3}")
        # while `starting()` (a stream waits for its first audio; with codec_starting_ahead_s, or a listener has
        # less than that much audio: the pipeline's `_ramping`) a call takes its urgent jobs, then frames while
        # its predicted time (call_model) stays within this many seconds: a first chunk rarely waits behind a long
        # call (None: no cap)
        self.starting, self.starting_s = starting, starting_s
        if starting_exempt_s is None:
            starting_exempt_s = CODEC_URGENT_S
        if not 0 <= starting_exempt_s <= CODEC_URGENT_S:
            raise ConfigError(f"codec_starting_exempt_s must lie in 0..{CODEC_URGENT_S}, got {starting_exempt_s}")
        self.starting_exempt_s = starting_exempt_s  # capped calls still take every job due within this (s; None: 0.3)
        # CUDA: the warm-up picks convolution plans with little memory free and captures graphs with room for their
        # activations, then caps the process at what it holds plus this many GB (engine/gpu_memory.py: a cuDNN plan
        # with a huge workspace returned wrong audio on an H200); None: no bounds
        self.memory_headroom_gb = memory_headroom_gb
        self.ramp_configs = tuple(ramp_configs)  # low-latency plans whose ramp windows `warm_up` prepares
        self.memory_cap: int | None = None  # bytes, once start() has bounded the process (None: no bound)
        self.native_check: float | None = None  # the warm-up's graphs vs native convolutions (None: not checked)
        self.call_model = LoopModel()  # a call's seconds vs its frames: fixed cost + per frame (codec thread)
        self._first: torch.cuda.Stream | None = None  # overdue calls' stream (highest priority), CUDA only
        self.pending: list[Pending] = []  # jobs taken from the rounds, not decoded yet (codec thread)
        self._ends: list[tuple] = []  # segment ends waiting for their segment's held jobs
        self.calls = 0
        self.busy_s = 0.0  # codec thread time in decode + s16 conversion
        self.call_s = 0.0  # EMA of one call's wall time
        self.call_peak_s = 0.0  # the longest recent call (halves each CALL_PEAK_HALF_LIFE_S without a longer one)
        self._peak_at = 0.0
        # benchmarks: ("codec", t0, t1, jobs, frames, steps, overdue, held frames, late s: see _decode_call)
        self.trace: list[tuple] | None = None
        # after each call: its seconds, the frames still held, and for a call holding an overdue job how late that
        # job was when the call began (None otherwise)
        self.on_call: Callable[[float, int, float | None], None] | None = None
        self.rounds: queue.Queue[Round | None] = queue.Queue(maxsize=queue_rounds)
        self._use_graphs = graphs
        self._warm = warm and self.device is not None
        self._stream: torch.cuda.Stream | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle (event loop) ----

    async def start(self, engine_stream: torch.cuda.Stream | None) -> None:
        """Pick the CUDA stream (the talker's `engine_stream` in "engine" mode), warm up, start the thread."""
        assert self._thread is None, "codec worker already started"
        self._loop = asyncio.get_running_loop()
        if self.device is not None and self.codec_sms is not None:
            from higgs_stream.engine.green_context import green_stream

            self._stream = green_stream(self.device, self.codec_sms)
            log.info("codec on a green context of %d SMs", self.codec_sms)
        elif self.device is not None:
            self._stream = (engine_stream if self.stream_mode == "engine" and engine_stream is not None
                            else torch.cuda.Stream(self.device, priority=0))
            if self.overdue_first:  # torch maps a priority beyond the device's range to its highest
                self._first = torch.cuda.Stream(self.device, priority=-100)
        if self._warm:
            t0 = time.perf_counter()
            shapes = await asyncio.to_thread(self.warm_up)
            log.info("codec warmed up at %d shapes in %.1f s (%d replayed from CUDA graphs)", shapes,
                     time.perf_counter() - t0, len(getattr(self.window_graphs, "shapes", ())))
        if self.device is not None:
            # the warm-up's eager steps leave blocks cached in torch's allocator; what allocates outside it
            # (the codec thread's cuBLAS handles, below) needs them back
            torch.cuda.empty_cache()
            self.memory_cap = bound_process_memory(self.device, self.memory_headroom_gb)  # the graphs keep what they took
            free, total = torch.cuda.mem_get_info(self.device)
            log.info("GPU memory after the codec warm-up: %.1f GB allocated by torch, %.1f GB free of %.1f GB",
                     torch.cuda.memory_allocated(self.device) / 1e9, free / 1e9, total / 1e9)
        self._thread = threading.Thread(target=self._run, name="higgs-codec", daemon=True)
        self._thread.start()

    async def stop(self, grace_s: float) -> None:
        """Let the thread finish the queued rounds and exit; give up on a stuck one after `grace_s`."""
        if self._thread is not None and self._thread.is_alive():
            try:
                await asyncio.to_thread(self.rounds.put, None, timeout=grace_s)
                await asyncio.to_thread(self._thread.join, grace_s)
            except queue.Full:
                log.error("codec thread stuck at stop; leaving it")

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- engine thread ----

    def submit(self, rnd: Round, timeout: float) -> bool:
        """Queue `rnd`; False when the queue stayed full for `timeout` seconds."""
        try:
            self.rounds.put(rnd, timeout=timeout)
            return True
        except queue.Full:
            return False

    # ---- codec thread ----

    def _run(self) -> None:
        with on_stream(self._stream):
            if self.device is not None:
                _prime_blas(self.device)
                if self._first is not None:  # the overdue calls' stream gets its workspaces now too
                    with after_and_before(self._first, self._stream):
                        _prime_blas(self.device)
            stop = False
            while not stop:
                flush = {id(e[1]) for e in self._ends}
                stop = self._take(wake_in(self.pending, time.monotonic(), self.busy(), flush))
                self._decode_due(everything=stop)

    def _take(self, wait: float | None) -> bool:
        """Move every queued round into `pending` / `_ends`, waiting up to `wait` seconds (None:
        until one comes) for the first. True when stop() was asked."""
        try:
            rnd = self.rounds.get() if wait is None else self.rounds.get(timeout=wait)
        except queue.Empty:
            return False
        while True:
            if rnd is None:
                return True
            deadlines = rnd.deadlines or [0.0] * len(rnd.jobs)
            now = time.monotonic()
            self.pending += [Pending(seg, job, d, now) for seg, job, d in zip(rnd.owners, rnd.jobs, deadlines)]
            self._ends += rnd.ends
            try:
                rnd = self.rounds.get_nowait()
            except queue.Empty:
                return False

    def _fits(self, frames: int) -> bool:
        """Whether a call of `frames` codec frames fits the time cap that holds while a stream starts (`starting_s`
        set; before any call is measured everything fits)."""
        t = self.call_model.predict(frames)
        return t is None or t <= self.starting_s

    def _decode_due(self, everything: bool = False) -> None:
        """Decode the due jobs of the `max_windows` most urgent streams (everything with `everything`:
        at stop) in one call — the rest stay held, so a first chunk that comes meanwhile goes in the
        next call, not after all of them — then hand over the ends whose segments have no held job left."""
        flush, now = {id(e[1]) for e in self._ends}, time.monotonic()
        take = list(self.pending) if everything else due(self.pending, now, flush, self.busy())
        if not everything and self.starting_s is not None and take and self.starting():
            take = within_cap(take, self._fits, now, self.starting_exempt_s)
        per_seg: dict[int, list[Pending]] = {}  # id(seg) -> its due jobs, in order
        for p in take:
            per_seg.setdefault(id(p.seg), []).append(p)
        order = list(per_seg.values())  # by each segment's most urgent job (`take` is sorted)
        cap = self.max_windows if everything else self.streams_per_call()
        stop = len(order) if everything else min(len(order), cap)
        for at in range(0, stop, cap):
            call = [p for jobs in order[at : at + cap] for p in jobs]
            taken = {id(p) for p in call}
            self.pending = [p for p in self.pending if id(p) not in taken]
            t = time.monotonic()  # its most overdue job waited this long (a deadline of 0: a round that gave none)
            late = max((t - p.deadline for p in call if p.deadline > 0), default=0.0)
            self._decode_call([(p.seg, p.job) for p in call], overdue=any(p.deadline <= now for p in call),
                              late_s=max(0.0, late))
        if self._ends:
            held = {id(p.seg) for p in self.pending}
            ready = [e for e in self._ends if id(e[1]) not in held]
            self._ends = [e for e in self._ends if id(e[1]) in held]
            for e in ready:  # after all their audio; a segment that ends frees its decoder state
                self.code2wav.release(e[1])
            self._send(ready)

    def streams_per_call(self) -> int:
        """`calm_windows` while the codec holds at most `behind_frames` codec frames, else `max_windows`: short calls
        while it keeps up (a first chunk waits less behind the call in flight), the larger calls' throughput once
        it has fallen behind (codec thread)."""
        if self.calm_windows == self.max_windows:
            return self.max_windows
        return self.max_windows if self.held_frames() > self.behind_frames else self.calm_windows

    def held_frames(self) -> int:
        """Codec frames made and not decoded yet (the jobs in `pending`; codec thread)."""
        return sum(p.job.codes.shape[1] for p in self.pending)

    def _decode_call(self, pairs: list[tuple[Any, Job]], overdue: bool = False, late_s: float = 0.0) -> None:
        """One codec call over `pairs`; `late_s` (the trace's 9th field): how long past its deadline the call's most
        overdue job was when the call began (a first chunk's deadline is its creation: its wait for the codec)."""
        owners, jobs = [seg for seg, _ in pairs], [job for _, job in pairs]
        first = self._first if overdue else None
        t0 = time.perf_counter()
        try:
            with after_and_before(first, self._stream):
                pcm = jobs_to_s16le(self.code2wav.run(owners, jobs))
            self.calls += 1
        except Exception as exc:
            log.exception("codec decode of %d jobs failed", len(jobs))
            segs = {id(seg): seg for seg in owners}.values()  # each once
            self._send([self._fail(seg, f"codec decode failed: {exc!r}") for seg in segs])
            return
        finally:
            t1 = time.perf_counter()
            took = t1 - t0
            held = 0  # the backlog (frames made, not yet decoded), counted when someone reads it
            if self.trace is not None or self.on_call is not None:
                held = self.held_frames()
            measured = self.trace is not None or (self.starting_s is not None and jobs)  # the call's frames read
            frames = sum(j.codes.shape[1] for j in jobs) if measured else 0
            if self.trace is not None:
                self.trace.append(("codec", t0, t1, len(jobs), frames, self.code2wav.steps, overdue, held, late_s))
            if self.on_call is not None:
                self.on_call(took, held, late_s if overdue else None)
            self.busy_s += took
            if self.starting_s is not None and jobs:  # the time cap's model of a call
                self.call_model.observe(frames, took)
            self.call_s += 0.05 * (took - self.call_s)  # EMA of a call's wall time (the pipeline's jitter estimate)
            fade = 0.5 ** ((t1 - self._peak_at) / CALL_PEAK_HALF_LIFE_S)
            self.call_peak_s, self._peak_at = max(took, self.call_peak_s * fade), t1  # one float store: read anywhere
        items: list[tuple] = []
        bad: set[int] = set()
        for seg, chunk in zip(owners, pcm):
            if id(seg) in bad:
                continue
            if chunk is None:  # non-finite audio: this segment only
                bad.add(id(seg))
                items.append(self._fail(seg, "codec output is not finite"))
            elif chunk:
                items.append(("audio", seg, chunk))
        self._send(items)

    def _fail(self, seg: Any, error: str) -> tuple:
        """End a segment whose audio the codec could not make: free its state, stop its engine
        stream; returns its ("end", ...) item."""
        self.code2wav.release(seg)
        self._cancel(seg.sid)
        return ("end", seg, "error", error, None)

    def _send(self, items: list[tuple]) -> None:
        if items:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                log.warning("event loop closed; dropped %d audio/end items", len(items))

    def forget_calls(self) -> None:
        """Start the call statistics afresh (`Pipeline.warm_up`): the warm-up utterance's calls carry first-use costs
        (H200, session 30: its final 33-frame call took 56-72 ms, an eager step at a width no bucket held, since cut
        into pieces by Code2Wav), which would otherwise size the first requests' first chunks for them. Each is one
        reference store, read anywhere."""
        self.call_model = LoopModel()
        self.call_s, self.call_peak_s, self._peak_at = 0.0, 0.0, 0.0

    def health(self) -> dict:
        """What /healthz shows of the codec: on CUDA whether it runs on cuDNN (False: the warm-up's native check
        turned it off, exact and slower) and that check's max |d| / peak (None: not run); on a CPU both None."""
        on_gpu = self.device is not None
        return {"cudnn": bool(getattr(self.codec, "cudnn", True)) if on_gpu else None, "native_check": self.native_check}

    def warm_up(self) -> int:
        """GPU: capture the stateful decoder's steps per (streams, frames) bucket, and warm up (and
        graph) the low-latency ramp windows' shapes. With a memory headroom, every shape's convolutions pick
        their cuDNN plans with little memory free first (engine/gpu_memory.py); the graphs are then checked
        against PyTorch's native convolutions (`_check_against_native`). Returns the number of shapes prepared."""
        dec = self.code2wav.streaming
        with on_stream(self._stream), torch.no_grad():
            frames = frame_buckets(self.code2wav.geometry, AdapterConfig().schedule[-1])
            batches = batch_buckets(self.max_windows)  # the stateful steps' (graphed) batch sizes
            green = self._stream if self.codec_sms is not None else None  # graphs keep to the green context's SMs
            lengths = set().union(*(window_lengths(c, self.code2wav.geometry) for c in self.ramp_configs))
            k = self.code2wav.geometry.num_codebooks

            def windows() -> None:  # every ramp window shape once, eagerly
                for b in CODEC_WINDOW_BUCKETS:
                    for w in sorted(lengths):
                        self.codec.decode(torch.zeros((b, k, w), dtype=torch.long)).cpu()

            def every_shape() -> None:  # each shape's first call: its convolutions pick their cuDNN plans
                dec.run_padding_steps(batches, frames)
                windows()

            if self.memory_headroom_gb is None:
                windows()  # (capture's own warm-up runs pick the stateful steps' plans)
            else:  # the plans picked with little memory free, then the graphs captured from them with room for
                # their activations (engine/gpu_memory.py)
                with_plan_headroom(self.device, every_shape)
                bound_process_memory(self.device, max(self.memory_headroom_gb, WARMUP_HEADROOM_GB))
            def capture() -> float:  # the stateful steps' graphs (again if the native check turns cuDNN off)
                return dec.capture(batches, frames, graphs=self._use_graphs, stream=green)

            diff = capture()
            if diff:
                log.warning("stateful codec graphs vs eager: max |d| %.3g of peak", diff)
            self._check_against_native(dec, capture)
            timings = getattr(dec, "timings", None)
            if timings:  # what a step costs on this card, smallest and largest bucket (operators' first look)
                (b0, f0), (b1, f1) = min(timings), max(timings)
                log.info("stateful codec step replays: %.2f ms at %d stream x %d frame ... %.2f ms at %d x %d",
                         1e3 * timings[b0, f0], b0, f0, 1e3 * timings[b1, f1], b1, f1)
            count = len(batches) * len(frames) + len(CODEC_WINDOW_BUCKETS) * len(lengths)
            if self._use_graphs:
                from higgs_stream.stream.codec_graphs import CodecGraphs

                graphs = CodecGraphs(self.codec, [(b, w) for b in CODEC_WINDOW_BUCKETS for w in lengths])
                diff = graphs.capture(stream=green)
                if diff == 0.0:
                    self.window_graphs = graphs
                    self.code2wav.window_decode = graphs.decode
                else:  # never trade exactness for speed: decode eagerly
                    log.error("codec CUDA graphs differ from the eager decode by %.3g; decoding eagerly", diff)
        return count

    def _check_against_native(self, dec, capture: Callable[[], float]) -> None:
        """The captured graphs of few rows x frames vs the same steps on PyTorch's native convolutions
        (`check_against_native`): above the tolerance a cuDNN plan on this card returns wrong sums, and the codec
        decodes with cuDNN off from then on (exact, slower; graphs captured again): never trade exactness for speed."""
        self.native_check = dec.check_against_native() if dec.graphed else None
        if self.native_check is None:
            return
        tolerance = NATIVE_TOLERANCE_TF32 if getattr(self.codec, "allow_tf32", False) else NATIVE_TOLERANCE
        if self.native_check <= tolerance:
            log.info("codec graphs vs PyTorch's native convolutions: max |d| %.3g of peak", self.native_check)
            return
        log.error("the codec's graphs differ from the same steps on PyTorch's native convolutions by %.3g of peak: "
                  "cuDNN is off for the codec (slower)", self.native_check)
        self.codec.cudnn = False
        capture()
        self.native_check = dec.check_against_native()


def frame_buckets(geometry, steady: int) -> tuple[int, ...]:
    """Frame widths the stateful steps are padded to: powers of two below the steady chunk (the ramp),
    the steady chunk itself, and a steady chunk's final push with its look-ahead flush (Higgs v2:
    1, 2, 4, 8, 16, 25, 35), so the common steps run unpadded."""
    ramp = [1 << i for i in range(steady.bit_length()) if 1 << i < steady]
    return tuple(sorted({*ramp, steady, steady + geometry.lookahead_frames}))


def cuda_device(device) -> torch.device | None:
    """`device` when it is a CUDA device, else None."""
    if device is None:
        return None
    device = torch.device(device)
    return device if device.type == "cuda" else None


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None):
    """Run this thread's device work on `stream` (after all work queued so far on the default one)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.default_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


@contextlib.contextmanager
def after_and_before(stream: torch.cuda.Stream | None, home: torch.cuda.Stream | None):
    """Run this thread's device work on `stream` (None: where it runs now), ordered after everything
    queued on `home` so far, and `home`'s later work after it (the decoder state both touch)."""
    if stream is None or home is None:
        yield
        return
    stream.wait_stream(home)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:  # a failed call too: what it queued stays ordered before the next call
        home.wait_stream(stream)


def _prime_blas(device: torch.device) -> None:
    """Create this thread's cuBLAS/cuBLASLt handles and their workspaces on the current stream now: torch
    creates them per thread at first use, and the codec thread's first matmul of an eager step (one
    outside the captured buckets) once came with the GPU full (CUBLAS_STATUS_ALLOC_FAILED, a served
    Qwen3-TTS 1.7B at 20 req/s on an H100)."""
    a = torch.ones((8, 8), device=device)
    torch.nn.functional.linear(a, a, a[0])
    torch.mm(a, a)

