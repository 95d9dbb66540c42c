"""Launches in flight between the model runner and the host.

A launch's sampled rows [S, K + 1] (K codes and a status per row) are copied back into one of `HOST_ROWS`
pinned buffers without blocking the host (`ship`); `run` collects them a step later (one launch stays in flight
while the next is staged), or at once in a synchronous step. While the host waits for the oldest launch, prompts
that arrive meanwhile are launched at once, each group in a launch of its own ("late" launches, at most
`LATE_PER_STEP` between two regular launches: arrivals cannot hold decode steps back for long); why, in
model_runner.py's docstring. Every wait on the device is timed (`wait_s`: whether a run is host-bound or
device-bound, for benchmarks)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from higgs_stream.engine.gpu_sampling import ERROR, IGNORED, RUNNING, STATUS_REASON
from higgs_stream.engine.runner import LateCall, RowOut
from higgs_stream.engine.scheduler import Chunk
from higgs_stream.engine.sequence import Sequence

LATE_POLL_S = 5e-4  # while waiting for a step: how often the host looks at its event when no prompt arrives
LATE_PER_STEP = 2  # late launches between two regular launches: what arrivals may put before the next decode
HOST_ROWS = 4  # pinned row buffers: launches in flight (a regular launch is made with <= 1 in flight, then <= 2 late)

log = logging.getLogger(__name__)


@dataclass
class Launched:
    """A launch whose sampled rows are still on their way to the host."""

    seqs: list[Sequence]  # sampled rows (prompt ends, then decode tokens), in packed-row order
    host: torch.Tensor  # [B, K + 1] pinned view being filled
    done: torch.cuda.Event | None


class LaunchQueue:
    """The launches in flight, oldest first. `launch_prompts(chunks)` launches late prompts (the runner's)."""

    def __init__(self, device: torch.device, max_batch: int, num_codebooks: int,
                 launch_prompts: Callable[[list[Chunk]], Launched | None]) -> None:
        self.device, self.k = device, num_codebooks
        pin = device.type == "cuda"
        self._host = [torch.zeros((max_batch, num_codebooks + 1), dtype=torch.long, pin_memory=pin)
                      for _ in range(HOST_ROWS)]
        self._next_host = 0
        self._flight: deque[Launched] = deque()
        self._launch_prompts = launch_prompts
        self.late_launches = 0  # prompt-only launches made while waiting
        self._lates = 0  # late launches since the last regular launch (<= LATE_PER_STEP)
        self.wait_s = 0.0  # host time spent waiting for the device

    def __len__(self) -> int:
        return len(self._flight)

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Block until `event` (None: nothing to wait for), timed into `wait_s`."""
        if event is not None:
            t0 = time.perf_counter()
            event.synchronize()
            self.wait_s += time.perf_counter() - t0

    def ship(self, packed: torch.Tensor, seqs: list[Sequence]) -> Launched:
        """Start copying a launch's packed rows [S, K + 1] to the host; what to collect them by."""
        host = self._host[self._next_host][: packed.shape[0]]
        self._next_host = (self._next_host + 1) % HOST_ROWS
        host.copy_(packed, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Launched(seqs, host, done)

    def run(self, launched: Launched | None, sync: bool, late: LateCall | None) -> list[RowOut]:
        """Queue this step's launch (None: nothing was planned), then return the rows of what was in flight
        before it (the oldest launch only, when nothing was launched because two were in flight); `sync`: every
        launch's rows, this one's too, and nothing stays in flight. `late`: prompts that arrive while the host
        waits, launched at once (in a synchronous step too: their first rows then come in this call)."""
        if launched is not None:
            self._flight.append(launched)
            self._lates = 0
        keep = 0 if sync else (1 if launched is not None or len(self._flight) >= 2 else 0)
        out: list[RowOut] = []
        for _ in range(len(self._flight) - keep):
            if late is not None:
                out += self._late(late, self._flight[0])
            out += self._collect(self._flight.popleft())
        while sync and self._flight:  # late launches made while a synchronous step ran
            out += self._collect(self._flight.popleft())
        return out

    def _late(self, late: LateCall, oldest: Launched) -> list[RowOut]:
        """Until `oldest` is done: prompts that arrive are launched at once, each group in a launch of its
        own (at most LATE_PER_STEP since the last regular launch); error rows of launches that failed."""
        out: list[RowOut] = []
        while self._lates < LATE_PER_STEP and len(self._flight) < HOST_ROWS:
            t0 = time.perf_counter()
            finished = oldest.done is None or oldest.done.query()
            chunks = late(0.0 if finished else LATE_POLL_S)
            self.wait_s += time.perf_counter() - t0
            if chunks:
                out += self._launch_late(chunks)
            elif finished:
                break
        return out

    def _launch_late(self, chunks: list[Chunk]) -> list[RowOut]:
        """One late launch of `chunks`; its streams' error rows if it failed (the steps in flight go on)."""
        self._lates += 1
        try:
            launched = self._launch_prompts(chunks)
        except Exception as exc:
            log.exception("late prompt launch failed")
            seqs = {id(c.seq): c.seq for c in chunks}.values()  # each once
            return [RowOut(s, [], "error", f"prompt launch failed: {exc!r}") for s in seqs]
        if launched is not None:
            self._flight.append(launched)
        self.late_launches += 1
        return []

    def _collect(self, launched: Launched) -> list[RowOut]:
        """A launch's rows, now on the host, in row order (sequences that ended meanwhile skipped)."""
        self.wait(launched.done)
        k = self.k
        rows = launched.host.numpy().tolist()  # [S, K + 1] plain ints: one conversion for the step
        out = []
        for seq, row in zip(launched.seqs, rows):
            status = row[k]
            if seq.finished or status == IGNORED:  # finished, cancelled or failed meanwhile
                continue
            if status == ERROR:
                out.append(RowOut(seq, [], "error", "non-finite audio logits"))
            else:
                out.append(RowOut(seq, [row[:k]], None if status == RUNNING else STATUS_REASON[status]))
        return out
