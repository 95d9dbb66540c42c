"""`serve --profile-out PREFIX` (diagnostics): deterministic profiles (cProfile) of the engine thread and
the codec thread, written as PREFIX.engine.pstats / PREFIX.codec.pstats when each thread ends (at
shutdown). cProfile slows Python-heavy code (every Python call is counted), so read the split of a
thread's host time between functions, not its absolute times. Read with
`python -m pstats FILE` or `python scripts/top_pstats.py FILE`."""

from __future__ import annotations

import contextlib
import cProfile
import logging

log = logging.getLogger(__name__)


@contextlib.contextmanager
def thread_profile(path: str | None):
    """Profile the calling thread while the block runs, and dump the stats to `path` (None: no profile)."""
    if path is None:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        try:
            prof.dump_stats(path)
            log.info("thread profile written to %s", path)
        except OSError as exc:  # diagnostics never take the server down
            log.error("could not write the thread profile %s: %r", path, exc)
