"""The codec worker: one thread that turns the engine thread's rounds of decode windows into audio.

The engine thread hands it one `Round` per step (`submit`, into a bounded queue of
`CODEC_QUEUE_ROUNDS` rounds: back-pressure when the codec is the bottleneck). The codec thread
takes every queued round at once (up to `max_windows` windows) into one batched decode call and
hands the audio and segment ends to the event loop in one `deliver(items)` call, in round order, so
each stream's chunks and its end keep their order. A failed decode ends only the segments in that
call (their engine streams are cancelled); the thread lives on.

On CUDA it decodes on its own low-priority stream (`stream_mode="separate"`) or on the talker's
(`"engine"`: the device then runs them back to back, only the host work overlaps). Calls use
bucketed shapes (the first call at a new shape is slow), warmed up by `start()`, and small ones
replay from CUDA graphs (stream/codec_graphs.py). A CPU codec decodes the exact shapes.

Segments are opaque here: the worker only reads `seg.sid` (to cancel a failed one in the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from higgs_stream.engine.errors import ConfigError
from higgs_stream.stream.adapter import DecodeJob, decode_jobs, jobs_to_s16le

log = logging.getLogger(__name__)

CODEC_QUEUE_ROUNDS = 8  # engine steps whose decode work may wait for the codec thread
CODEC_MAX_WINDOWS = 64  # windows the codec thread merges into one call from several queued rounds
# GPU codec shape buckets: calls are padded to these batch sizes and padded windows to a multiple
# of CODEC_LENGTH_QUANTUM frames (the exact default's 45-frame windows decode at 48).
CODEC_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
CODEC_LENGTH_QUANTUM = 8
CODEC_WARM_LENGTHS = (16, 24, 32, 40, 48)  # padded window lengths warmed up at start (GPU)
CODEC_GRAPH_MAX_BATCH = 16  # warmed shapes up to this batch replay from CUDA graphs (launch-bound)
CODEC_STREAMS = ("separate", "engine")  # the codec's CUDA stream: its own (low priority) or the talker's


@dataclass
class Round:
    """One engine step's output for the codec thread: windows to decode (jobs[i] belongs to
    owners[i]) and the segment ends that must follow their audio."""

    jobs: list[DecodeJob]
    owners: list[Any]  # pipeline segments (opaque here; `.sid` is read on a codec failure)
    ends: list[tuple]  # ("end", seg, reason, error, frames)


class CodecWorker:
    """Batched decode rounds on their own thread (and CUDA stream). `cancel(sid)` stops a failed
    segment's engine stream; `deliver(items)` runs on the event loop with ("audio", seg, pcm) and
    ("end", seg, reason, error, frames) items in order."""

    def __init__(self, codec, cancel: Callable[[int], None], deliver: Callable[[list[tuple]], None], *,
                 warm: bool = True, graphs: bool = True, stream_mode: str = "separate",
                 max_windows: int = CODEC_MAX_WINDOWS):
        if stream_mode not in CODEC_STREAMS:
            raise ConfigError(f"codec_stream must be one of {CODEC_STREAMS}, got {stream_mode!r}")
        if max_windows < 1:
            raise ConfigError(f"codec_max_windows must be >= 1, got {max_windows}")
        self.codec = codec
        self.decoder = codec  # what the codec thread decodes with (CodecGraphs after a GPU warm-up)
        self._cancel, self._deliver = cancel, deliver
        self.stream_mode, self.max_windows = stream_mode, max_windows
        self.calls = 0
        self.busy_s = 0.0  # codec thread time in decode + s16 conversion
        self.rounds: queue.Queue[Round | None] = queue.Queue(maxsize=CODEC_QUEUE_ROUNDS)
        self.device = cuda_device(getattr(codec, "device", None))
        self._use_graphs = graphs
        self._warm = warm and self.device is not None
        self._stream: torch.cuda.Stream | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # GPU codec: bucketed call shapes (a CPU codec decodes the exact shapes)
        self._shapes = ({"batch_buckets": CODEC_BATCH_BUCKETS, "length_quantum": CODEC_LENGTH_QUANTUM}
                        if self.device is not None else {})

    # ---- lifecycle (event loop) ----

    async def start(self, engine_stream: torch.cuda.Stream | None) -> None:
        """Pick the CUDA stream (the talker's `engine_stream` in "engine" mode), warm up, start the thread."""
        assert self._thread is None, "codec worker already started"
        self._loop = asyncio.get_running_loop()
        if self.device is not None:
            self._stream = (engine_stream if self.stream_mode == "engine" and engine_stream is not None
                            else torch.cuda.Stream(self.device, priority=0))
        if self._warm:
            t0 = time.perf_counter()
            shapes = await asyncio.to_thread(self.warm_up)
            log.info("codec warmed up at %d shapes in %.1f s (%d replayed from CUDA graphs)", shapes,
                     time.perf_counter() - t0, len(getattr(self.decoder, "shapes", ())))
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
            while True:
                rounds = [self.rounds.get()]
                windows = len(rounds[0].jobs) if rounds[0] is not None else 0
                while rounds[-1] is not None:  # merge what else is queued, up to max_windows
                    try:
                        nxt = self.rounds.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is not None and windows + len(nxt.jobs) > self.max_windows:
                        self._decode_rounds(rounds)
                        rounds, windows = [], 0
                    rounds.append(nxt)
                    windows += len(nxt.jobs) if nxt is not None else 0
                stop = rounds[-1] is None
                rounds = [r for r in rounds if r is not None]
                if rounds:
                    self._decode_rounds(rounds)
                if stop:
                    return

    def _decode_rounds(self, rounds: list[Round]) -> None:
        """One batched codec call for all windows of `rounds`; hands audio and ends to the event
        loop in round order. A codec failure ends the affected segments; the thread lives on."""
        jobs = [j for r in rounds for j in r.jobs]
        pcm: list[bytes | None] = []
        failed: dict[int, str] = {}  # id(segment) -> error
        if jobs:
            t0 = time.perf_counter()
            try:
                pcm = jobs_to_s16le(decode_jobs(self.decoder, jobs, **self._shapes))
                self.calls += 1
                self.busy_s += time.perf_counter() - t0
            except Exception as exc:
                log.exception("codec decode of %d windows failed", len(jobs))
                pcm = [None] * len(jobs)
                failed = {id(seg): f"codec decode failed: {exc!r}" for r in rounds for seg in r.owners}
        items: list[tuple] = []
        at = 0
        for r in rounds:
            for seg, chunk in zip(r.owners, pcm[at : at + len(r.jobs)]):
                if chunk is None:
                    failed.setdefault(id(seg), "codec output is not finite")
                if id(seg) not in failed:
                    items.append(("audio", seg, chunk))
            at += len(r.jobs)
            items += [e for e in r.ends if id(e[1]) not in failed]
        if failed:
            segs = {id(seg): seg for r in rounds for seg in r.owners if id(seg) in failed}
            for key, seg in segs.items():
                self._cancel(seg.sid)
                items.append(("end", seg, "error", failed[key], None))
        if items:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                log.warning("event loop closed; dropped %d audio/end items", len(items))

    def warm_up(self) -> int:
        """Decode each bucketed shape once (GPU): the first call at a new shape builds its kernels."""
        from higgs_stream.stream.chunking import AdapterConfig, ChunkPlanner

        lengths = {b: set(CODEC_WARM_LENGTHS) for b in CODEC_BATCH_BUCKETS}
        ll = ChunkPlanner(AdapterConfig(mode="low_latency"))  # its ramp windows cannot be padded
        for _ in range(200):
            ll.available += 1
            if (w := ll.next_window()) is not None:
                ll.advance(w)
                if w.right < ll.cfg.receptive_field:
                    for b in CODEC_BATCH_BUCKETS[:6]:
                        lengths[b].add(w.stop - w.start)
        count = 0
        with on_stream(self._stream), torch.no_grad():
            for b, ws in lengths.items():
                for w in sorted(ws):
                    self.codec.decode(torch.zeros((b, 8, w), dtype=torch.long)).cpu()
                    count += 1
            if self._use_graphs:
                from higgs_stream.stream.codec_graphs import CodecGraphs

                graphs = CodecGraphs(self.codec, [(b, w) for b, ws in lengths.items() if b <= CODEC_GRAPH_MAX_BATCH
                                                  for w in ws])
                diff = graphs.capture()
                if diff == 0.0:
                    self.decoder = graphs
                else:  # never trade exactness for speed: decode eagerly
                    log.error("codec CUDA graphs differ from the eager decode by %.3g; decoding eagerly", diff)
        return count


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
