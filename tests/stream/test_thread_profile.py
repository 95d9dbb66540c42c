"""serve --profile-out's sampler (stream/thread_profile.py): each thread's innermost function and its
callers are counted per sample, the sampler's own thread is not; writing never raises."""

from __future__ import annotations

import json
import logging
import threading

from higgs_stream.stream.thread_profile import StackSampler, write_profile


def _inner(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait()


def _outer(ready: threading.Event, release: threading.Event) -> None:
    _inner(ready, release)


def test_samples_count_each_threads_leaf_and_callers():
    ready, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_outer, args=(ready, release), name="parked")
    t.start()
    ready.wait()
    sampler = StackSampler()
    try:
        for _ in range(5):  # explicit samples: the parked thread sits in _inner's wait the whole time
            sampler.sample()
    finally:
        release.set()
        t.join()
    prof = sampler.profile(wall_s=1.0)
    parked = prof["threads"]["parked"]
    assert prof["samples"] == 5 and parked["samples"] == 5
    leaf = dict(parked["leaf"])
    assert sum(leaf.values()) == 5 and next(iter(leaf)).startswith("wait ")  # threading.Event.wait / Condition.wait
    cum = {k.split(" ")[0]: v for k, v in parked["cum"]}
    assert cum["_inner"] == cum["_outer"] == 5


def test_the_sampler_thread_runs_and_leaves_itself_out(tmp_path):
    sampler = StackSampler(interval_s=0.001)
    sampler.start()
    for _ in range(10_000):  # polls the sampler's own counter (bounded: ~10 s at most)
        if sampler.samples >= 3:
            break
        threading.Event().wait(0.001)
    prof = sampler.stop()
    assert prof["samples"] >= 3 and "MainThread" in prof["threads"]
    assert "higgs-stack-sampler" not in prof["threads"]
    path = tmp_path / "p.json"
    write_profile(prof, str(path))
    assert json.loads(path.read_text())["samples"] == prof["samples"]


def test_an_unwritable_path_is_logged_not_raised(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="higgs_stream.stream.thread_profile"):
        write_profile({"samples": 0}, str(tmp_path / "missing_dir" / "p.json"))
    assert "could not write the thread profile" in caplog.text
