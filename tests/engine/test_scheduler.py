"""Admission and chunked-prefill planning (plain Python: no model, no torch)."""

from __future__ import annotations

import random

import pytest

from higgs_stream.engine.errors import CapacityError, ConfigError, NotFoundError
from higgs_stream.engine.scheduler import Chunk, Scheduler, SchedulerConfig


def plan_of(chunks: list[Chunk]) -> list[tuple[int, int, int, bool, bool]]:
    return [(c.sid, c.start, c.num_tokens, c.prefill, c.last_of_prompt) for c in chunks]


def test_chunked_prefill_and_decode_first():
    s = Scheduler(SchedulerConfig(max_batch=4, token_budget=10, num_pages=100, page_size=4))
    s.add(0, prompt_len=4, max_tokens=20)
    s.add(1, prompt_len=15, max_tokens=30)
    assert plan_of(s.schedule()) == [(0, 0, 4, True, True), (1, 0, 6, True, False)]
    # stream 0 decodes first; stream 1 continues its prompt with the rest of the budget
    assert plan_of(s.schedule()) == [(0, 4, 1, False, False), (1, 6, 9, True, True)]
    s.add(2, prompt_len=30, max_tokens=40)
    assert plan_of(s.schedule()) == [(0, 5, 1, False, False), (1, 15, 1, False, False), (2, 0, 8, True, False)]
    s.finish(0)
    assert plan_of(s.schedule()) == [(1, 16, 1, False, False), (2, 8, 9, True, False)]


def test_admission_is_fifo_and_bounded_by_pages_and_batch():
    s = Scheduler(SchedulerConfig(max_batch=2, token_budget=100, num_pages=10, page_size=4))
    s.add(0, 4, 16)  # 4 pages
    s.add(1, 4, 24)  # 6 pages
    s.add(2, 4, 4)  # 1 page: would fit, but must not jump the queue... and the batch is full anyway
    assert [c.sid for c in s.schedule()] == [0, 1]
    assert s.committed_pages == 10 and s.num_waiting == 1
    assert [c.sid for c in s.schedule()] == [0, 1]
    s.finish(1)
    assert s.committed_pages == 4
    assert [c.sid for c in s.schedule()] == [0, 2]

    s2 = Scheduler(SchedulerConfig(max_batch=8, token_budget=100, num_pages=10, page_size=4))
    s2.add(0, 4, 32)  # 8 pages
    s2.add(1, 4, 16)  # 4 pages: does not fit next to stream 0
    s2.add(2, 4, 4)  # 1 page: fits, but the head of the queue is never skipped
    assert [c.sid for c in s2.schedule()] == [0]
    s2.finish(0)
    assert [c.sid for c in s2.schedule()] == [1, 2]


def test_refusals_and_unknown_streams():
    s = Scheduler(SchedulerConfig(max_batch=1, token_budget=8, max_waiting=2, num_pages=4, page_size=4))
    with pytest.raises(CapacityError, match="KV pages"):
        s.add(0, 4, 17)  # 5 pages > 4
    s.add(1, 4, 8)
    s.add(2, 4, 8)
    with pytest.raises(CapacityError, match="waiting"):
        s.add(3, 4, 8)
    s.finish(2)  # a waiting stream can be dropped
    with pytest.raises(NotFoundError):
        s.finish(2)
    with pytest.raises(ConfigError):
        SchedulerConfig(max_batch=8, token_budget=4)
    with pytest.raises(ConfigError):
        SchedulerConfig(page_size=0)


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_invariants(seed):
    """Positions of each stream are planned contiguously from 0, prompt first, one decode token per
    step after it; budget, batch and page commitments always hold; every stream is eventually served."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(max_batch=5, token_budget=24, max_waiting=100, num_pages=60, page_size=8)
    s = Scheduler(cfg)
    streams: dict[int, dict] = {}
    next_id = 0
    for step in range(400):
        if next_id < 30 and rng.random() < 0.3:
            p = rng.randint(1, 70)
            streams[next_id] = {"prompt": p, "max": p + rng.randint(1, 60), "pos": 0, "decoded": 0,
                                "done": False, "stop_after": rng.randint(1, 40)}
            s.add(next_id, p, streams[next_id]["max"])
            next_id += 1
        plan = s.schedule()
        assert sum(c.num_tokens for c in plan) <= cfg.token_budget
        assert len({c.sid for c in plan}) == len(plan) <= cfg.max_batch
        assert s.num_running <= cfg.max_batch and s.committed_pages <= cfg.num_pages
        for c in plan:
            st = streams[c.sid]
            assert c.start == st["pos"], (c, st)
            if c.prefill:
                assert c.end <= st["prompt"] and c.last_of_prompt == (c.end == st["prompt"])
            else:
                assert c.num_tokens == 1 and c.start >= st["prompt"]
                st["decoded"] += 1
            st["pos"] = c.end
            if st["decoded"] >= min(st["stop_after"], st["max"] - st["prompt"]):
                s.finish(c.sid)
                st["done"] = True
    assert all(st["done"] for st in streams.values()) and next_id == 30
    assert not s.has_work() and s.committed_pages == 0


def test_paused_streams_keep_their_place_and_leave_the_plan():
    s = Scheduler(SchedulerConfig(max_batch=4, token_budget=10, num_pages=100, page_size=4))
    s.add(0, prompt_len=2, max_tokens=20)
    s.add(1, prompt_len=2, max_tokens=20)
    s.schedule()  # both prompts
    s.pause(0)
    s.pause(7)  # not running: ignored
    assert s.num_paused == 1 and s.has_work()
    assert plan_of(s.schedule()) == [(1, 2, 1, False, False)]
    s.pause(1)
    assert not s.has_work() and s.schedule() == []  # everything paused: nothing to plan
    s.resume(0)
    assert plan_of(s.schedule()) == [(0, 2, 1, False, False)]  # continues where it stopped
    s.finish(1)  # finishing a paused stream forgets the pause
    assert s.num_paused == 0 and s.num_running == 1
