"""What stops a serving pipeline's threads, watched: Python's garbage collections (stream/gc_pauses.py) and kernels
built on first use (stream/kernel_builds.py). Both are counted in the pipeline's metrics of the moment (its warm-up
swaps them) and traced in its trace (`serve --trace-out`); what start-up did is kept apart from what serving does."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from higgs_stream.stream.gc_pauses import GcWatch
from higgs_stream.stream.kernel_builds import BuildWatch

if TYPE_CHECKING:
    from higgs_stream.stream.pipeline import Pipeline

log = logging.getLogger(__name__)


class ServingWatch:
    """The pipeline's watches: `watch_builds` (before the codec's warm-up: it builds kernels too), `watch_collections`,
    `mark_serving` once start-up is over, `close`."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline
        self.serving = False  # start-up is over: a kernel built from now on is a live request's cost
        self.start_builds = [0, 0.0]  # kernels built after the watch began and before serving, and their seconds
        self._builds: BuildWatch | None = None
        self._collections: GcWatch | None = None

    def watch_builds(self) -> None:
        self._builds = BuildWatch(self._kernel_built)

    def watch_collections(self) -> None:
        self._collections = GcWatch(self._gc_paused)

    def close(self) -> None:
        for watch in (self._collections, self._builds):
            if watch is not None:
                watch.close()
        self._collections = self._builds = None

    def mark_serving(self) -> None:
        """Start-up is over (warm-up run, start-up's objects frozen, the port about to open): the trace
        says so, and its summary keeps start-up's own collection apart from the pauses listeners feel; a kernel
        built from now on is counted as serving's (`_kernel_built`)."""
        self.serving = True
        if self.start_builds[0]:
            log.info("start-up built %d kernels in %.1f s after the model loaded (stream/kernel_builds.py)",
                     self.start_builds[0], self.start_builds[1])
        if self._pipeline.trace is not None:
            self._pipeline.trace.append(("serving", time.monotonic()))

    def _kernel_built(self, kind: str, name: str, start: float, seconds: float) -> None:
        """A Triton specialization or a dynamo compilation was built (stream/kernel_builds.py). While serving it
        stalled the thread that launched it and every stream behind that thread: counted, logged, traced; a
        shape the warm-up should have covered."""
        if not self.serving:
            self.start_builds[0] += 1
            self.start_builds[1] += seconds
            return
        metrics, trace = self._pipeline.metrics, self._pipeline.trace
        metrics.kernel_builds.inc(kind=kind)
        metrics.kernel_build_seconds.inc(seconds, kind=kind)
        log.warning("a %s kernel was built while serving, in %.0f ms on thread %s (a first use the warm-up did not "
                    "cover): %s", kind, 1e3 * seconds, threading.current_thread().name, name)
        if trace is not None:
            trace.append(("build", start, start + seconds, kind, name))

    def _gc_paused(self, generation: int, start: float, seconds: float) -> None:
        """Every garbage collection stops every thread: counted, and traced (`serve --trace-out`)."""
        self._pipeline.metrics.gc_pause.observe(seconds)
        trace = self._pipeline.trace
        if trace is not None:
            trace.append(("gc", start, start + seconds, generation))
