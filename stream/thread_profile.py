"""`serve --profile-out FILE` (diagnostics): a sampling profile of every thread of the server (the event
loop, the engine thread, the codec thread, ...), written as JSON when the server stops.

A sampler thread wakes every `interval_s` and reads each thread's Python stack (`sys._current_frames`):
per thread it counts the innermost Python function ("leaf": where its time goes, a C call such as a
graph replay or a device wait counted at the Python function that made it) and every function on the
stack ("cum"). Counts times the interval estimate seconds. Deterministic profilers do not fit here: from
Python 3.12 cProfile is one profiler per process, and it slows every Python call of the threads it
watches. The sampler costs one stack walk per thread per sample (tens of microseconds under the GIL)."""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
import time
from collections import Counter

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.002
TOP = 60  # functions kept per thread and kind in the written profile


@functools.lru_cache(maxsize=4096)
def frame_key(code) -> str:
    """'function (folder/file.py:first line)' of a code object (cached: the sampler names the same few
    hundred code objects at every sample, holding the GIL while it does)."""
    return f"{code.co_name} ({'/'.join(code.co_filename.rsplit('/', 2)[-2:])}:{code.co_firstlineno})"


class StackSampler:
    """Samples every thread's Python stack from a daemon thread of its own; `stop()` returns the profile."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.samples = 0
        self.leaf: dict[str, Counter] = {}
        self.cum: dict[str, Counter] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="higgs-stack-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """One sample of every thread but the sampler's own."""
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            name = names.get(tid, f"thread-{tid}")
            leaf, cum = self.leaf.setdefault(name, Counter()), self.cum.setdefault(name, Counter())
            leaf[frame_key(frame.f_code)] += 1
            seen = set()
            while frame is not None:
                seen.add(frame_key(frame.f_code))
                frame = frame.f_back
            cum.update(seen)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.profile(time.monotonic() - self._started)

    def profile(self, wall_s: float) -> dict:
        threads = {}
        for name, leaf in self.leaf.items():
            n = sum(leaf.values())
            threads[name] = {"samples": n, "leaf": leaf.most_common(TOP), "cum": self.cum[name].most_common(TOP)}
        return {"interval_s": self.interval_s, "samples": self.samples, "wall_s": wall_s,
                "threads": dict(sorted(threads.items(), key=lambda kv: -kv[1]["samples"]))}


def write_profile(profile: dict, path: str) -> None:
    """Write a profile; diagnostics never take the server down (an error is logged)."""
    try:
        with open(path, "w") as f:
            json.dump(profile, f, indent=1)
        log.info("thread profile (%d samples) written to %s", profile["samples"], path)
    except OSError as exc:
        log.error("could not write the thread profile %s: %r", path, exc)
