"""Python's garbage collector and the listeners: freeze what start-up made, time every collection.

A full (generation 2) collection stops every thread of the process while it walks every tracked
object. A server process holds hundreds of thousands of them from start-up alone (the model's
modules, torch, transformers, aiohttp; ~200k after the imports, 81 ms for one full collection on a
2-core CI machine), and per-step bookkeeping keeps triggering full collections now and then: each
one stalls the engine loop, the codec thread and the event loop together, so every stream in flight
gets a gap at the same moment. `freeze_startup()` moves everything alive after start-up into the
permanent generation (`gc.freeze()`), which collections skip; objects made later are still
collected as usual. `GcWatch` times every collection (the `higgs_gc_pause_seconds` histogram, and
the trace of `serve --trace-out`)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable


def freeze_startup() -> int:
    """Collect once, then freeze every object still alive (start-up's). Returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcWatch:
    """Calls `on_pause(generation, start, seconds)` after every collection (monotonic seconds) while
    installed. Install once per process part that wants it; `close()` removes it."""

    def __init__(self, on_pause: Callable[[int, float, float], None]) -> None:
        self._on_pause = on_pause
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.monotonic()
        else:
            self._on_pause(info.get("generation", -1), self._started, time.monotonic() - self._started)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
