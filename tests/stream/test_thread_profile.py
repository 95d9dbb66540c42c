"""serve --profile-out's thread profiles (stream/thread_profile.py): what runs in the block is counted and
written; no path, no profile; a path that cannot be written is logged, never raised."""

from __future__ import annotations

import logging
import pstats
import threading

from higgs_stream.stream.thread_profile import thread_profile


def _busy_leaf(n: int) -> int:
    return sum(i * i for i in range(n))


def _in_thread(path) -> None:
    def body():
        with thread_profile(path):
            for _ in range(3):
                _busy_leaf(1000)

    t = threading.Thread(target=body)
    t.start()
    t.join()


def test_a_threads_calls_are_counted_and_written(tmp_path):
    path = tmp_path / "x.engine.pstats"
    _in_thread(str(path))
    stats = pstats.Stats(str(path)).stats  # {(file, line, name): (primitive calls, calls, tt, ct, callers)}
    calls = {name: v[1] for (_, _, name), v in stats.items()}
    assert calls["_busy_leaf"] == 3


def test_no_path_no_profile(tmp_path):
    _in_thread(None)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_path_is_logged_not_raised(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="higgs_stream.stream.thread_profile"):
        _in_thread(str(tmp_path / "missing_dir" / "x.pstats"))
    assert "could not write the thread profile" in caplog.text
