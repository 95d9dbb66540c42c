"""Garbage collection and the listeners: start-up's objects frozen out of collections, every
collection timed (the metric and the trace)."""

from __future__ import annotations

import gc

from higgs_stream.stream.gc_pauses import GcWatch, freeze_startup


def test_freeze_moves_live_objects_out_of_collections():
    keep = [[i] for i in range(10_000)]  # tracked containers alive "at start-up"
    try:
        frozen = freeze_startup()
        # frozen objects can die (other threads free theirs), none joins without a freeze: the count only falls
        assert frozen >= len(keep) and len(keep) <= gc.get_freeze_count() <= frozen
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(x) in tracked for x in keep[:100])  # frozen objects are not scanned any more
    finally:
        gc.unfreeze()
    tracked = {id(o) for o in gc.get_objects()}
    assert all(id(x) in tracked for x in keep[:100])


def test_every_collection_is_reported_with_its_generation_and_duration():
    seen: list[tuple[int, float, float]] = []
    watch = GcWatch(lambda gen, start, seconds: seen.append((gen, start, seconds)))
    try:
        gc.collect(1)
        gc.collect()
    finally:
        watch.close()
    gens = [g for g, _, _ in seen]
    assert gens[-2:] == [1, 2]
    assert all(s >= 0.0 and start > 0.0 for _, start, s in seen)
    n = len(seen)
    gc.collect()
    assert len(seen) == n  # closed: no more reports
