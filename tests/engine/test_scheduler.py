"""Admission and chunked-prefill planning over `Sequence`s (plain Python: no model, no torch)."""

from __future__ import annotations

import random

import pytest

from higgs_stream.engine.errors import CapacityError, ConfigError, NotFoundError
from higgs_stream.engine.scheduler import Chunk, PrefillScheduler, Scheduler, SchedulerConfig
from higgs_stream.engine.sequence import Sequence


class _Prompt:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class Streams:
    """A scheduler and the sequences added to it by id (what the engine keeps)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.seqs = sched, {}

    def add(self, sid: int, prompt_len: int, max_tokens: int) -> Sequence:
        seq = Sequence(sid, request=None, prompt=_Prompt(prompt_len), params=None, max_frames=0, segment=None,
                       writer=None, max_tokens=max_tokens)
        self.sched.add(seq)
        self.seqs[sid] = seq
        return seq

    def finish(self, sid: int) -> None:
        self.sched.finish(self.seqs[sid])

    def pause(self, sid: int) -> None:
        if sid in self.seqs:
            self.sched.pause(self.seqs[sid])

    def resume(self, sid: int) -> None:
        self.sched.resume(self.seqs[sid])

    def __getattr__(self, name: str):  # schedule, committed_pages, num_waiting, ...: the scheduler's
        return getattr(self.sched, name)


def plan_of(chunks: list[Chunk]) -> list[tuple[int, int, int, bool, bool]]:
    return [(c.sid, c.start, c.num_tokens, c.prefill, c.last_of_prompt) for c in chunks]


def test_chunked_prefill_and_decode_first():
    s = Streams(Scheduler(SchedulerConfig(max_batch=4, token_budget=10, num_pages=100, page_size=4)))
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
    s = Streams(Scheduler(SchedulerConfig(max_batch=2, token_budget=100, num_pages=10, page_size=4)))
    s.add(0, 4, 16)  # 4 pages
    s.add(1, 4, 24)  # 6 pages
    s.add(2, 4, 4)  # 1 page: would fit, but must not jump the queue... and the batch is full anyway
    assert [c.sid for c in s.schedule()] == [0, 1]
    assert s.committed_pages == 10 and s.num_waiting == 1
    assert [c.sid for c in s.schedule()] == [0, 1]
    s.finish(1)
    assert s.committed_pages == 4
    assert [c.sid for c in s.schedule()] == [0, 2]

    s2 = Streams(Scheduler(SchedulerConfig(max_batch=8, token_budget=100, num_pages=10, page_size=4)))
    s2.add(0, 4, 32)  # 8 pages
    s2.add(1, 4, 16)  # 4 pages: does not fit next to stream 0
    s2.add(2, 4, 4)  # 1 page: fits, but the head of the queue is never skipped
    assert [c.sid for c in s2.schedule()] == [0]
    s2.finish(0)
    assert [c.sid for c in s2.schedule()] == [1, 2]


def test_refusals_and_unknown_streams():
    s = Streams(Scheduler(SchedulerConfig(max_batch=1, token_budget=8, max_waiting=2, num_pages=4, page_size=4)))
    with pytest.raises(CapacityError, match="KV pages"):
        s.add(0, 4, 17)  # 5 pages > 4
    assert s.num_waiting == 0
    s.add(1, 4, 8)
    s.add(2, 4, 8)
    with pytest.raises(CapacityError, match="waiting"):
        s.add(3, 4, 8)
    s.finish(2)  # a waiting stream can be dropped
    with pytest.raises(NotFoundError):
        s.finish(2)
    assert s.seqs[2].finished
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
    s = Streams(Scheduler(cfg))
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
    s = Streams(Scheduler(SchedulerConfig(max_batch=4, token_budget=10, num_pages=100, page_size=4)))
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


def test_prefill_chunks_do_not_depend_on_other_streams():
    """PrefillScheduler: a prompt is cut at multiples of `chunk` whatever else runs; a chunk waits
    for a budget that holds it whole; decode tokens first; the oldest prompt never starves."""

    def cuts(plans, sid):
        return [(c.start, c.end) for c in plans if c.sid == sid and c.prefill]

    with pytest.raises(ConfigError):
        PrefillScheduler(SchedulerConfig(max_batch=4, token_budget=20, num_pages=64), 16)
    for others in ((), (37, 5), (60, 61, 2)):
        s = Streams(PrefillScheduler(SchedulerConfig(max_batch=4, token_budget=21, num_pages=256, page_size=4), 16))
        plans = []
        for j, n in enumerate(others):
            s.add(100 + j, n, n + 200)
        plans += s.schedule()  # the others start first and take budget
        s.add(7, 45, 200)
        for _ in range(30):
            plan = s.schedule()
            plans += plan
            assert sum(c.num_tokens for c in plan) <= 21
            kinds = [c.prefill for c in plan]
            assert kinds == sorted(kinds)  # decode tokens first
        assert cuts(plans, 7) == [(0, 16), (16, 32), (32, 45)], others
    # a forced start row (v2): the prompt's last chunk brings the first decode token (position 45) into its plan
    s = Streams(PrefillScheduler(SchedulerConfig(max_batch=4, token_budget=21, num_pages=256, page_size=4), 16,
                                 fold_first_decode=True))
    s.add(7, 45, 200)
    plans = [s.schedule() for _ in range(4)]
    assert [(c.start, c.num_tokens, c.prefill) for c in plans[2]] == [(32, 13, True), (45, 1, False)]
    assert [(c.start, c.prefill) for c in plans[3]] == [(46, False)]
