"""Admission and chunked-prefill scheduling under a token budget (plain Python, no torch).

Every step the scheduler plans one forward:

1. every decoding stream gets 1 token (its last column), oldest first: real-time streams never
   wait behind prefill;
2. streams part-way through their prompt continue it, in admission order, with what is left of
   the token budget;
3. waiting streams are admitted first-come first-served while a batch slot, budget and KV room
   remain; the queue head is never skipped (no starvation).

A decoding stream can be paused (`pause`/`resume`): it keeps its pages and position and is left
out of the plan until resumed (the serving layer pauses streams far ahead of their listener).

KV room is committed at admission for the stream's worst case (prompt + every column it may feed
back, `max_kv_tokens`), so a running stream can never run out of pages mid-utterance and nothing
is ever preempted. Pages themselves are reserved lazily, step by step, inside that commitment.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from higgs_stream.engine.errors import CapacityError, ConfigError, NotFoundError


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # streams admitted at once (prefilling + decoding)
    token_budget: int = 2048  # tokens per forward (decode tokens + prefill chunks)
    max_waiting: int = 256  # queued streams beyond which add() raises CapacityError
    num_pages: int = 1024  # KV pages in the cache
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_batch", "token_budget", "max_waiting", "num_pages", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"scheduler {name} must be a positive int, got {value!r}")
        if self.token_budget < self.max_batch:
            raise ConfigError(
                f"token_budget ({self.token_budget}) must be >= max_batch ({self.max_batch}) so every "
                f"decoding stream gets its token each step"
            )

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + num_tokens) of one stream run in this step."""

    sid: int
    start: int
    num_tokens: int
    prefill: bool  # prompt tokens (else one decode token: the previous column)
    last_of_prompt: bool  # this chunk ends the prompt: the stream's AUDIO_INIT step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class _Entry:
    sid: int
    prompt_len: int
    max_tokens: int
    pages: int
    computed: int = 0  # positions already in the KV cache (or scheduled into it)

    @property
    def decoding(self) -> bool:
        return self.computed >= self.prompt_len


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._waiting: deque[_Entry] = deque()
        self._running: dict[int, _Entry] = {}  # admission order (dicts keep insertion order)
        self._paused: set[int] = set()  # running streams left out of decode plans
        self.committed_pages = 0

    # ----- queue management -----
    def add(self, sid: int, prompt_len: int, max_tokens: int) -> None:
        """Queue a stream; CapacityError when the waiting queue is full or it can never fit."""
        cfg = self.config
        assert 1 <= prompt_len <= max_tokens, f"need 1 <= prompt_len ({prompt_len}) <= max_tokens ({max_tokens})"
        pages = cfg.pages_for(max_tokens)
        if pages > cfg.num_pages:
            raise CapacityError(f"stream needs {pages} KV pages at most, the cache has {cfg.num_pages}")
        if len(self._waiting) >= cfg.max_waiting:
            raise CapacityError(f"{len(self._waiting)} streams already waiting (max_waiting={cfg.max_waiting})")
        self._waiting.append(_Entry(sid, prompt_len, max_tokens, pages))

    def finish(self, sid: int) -> None:
        """Forget a stream (finished, cancelled or failed) and release its KV commitment."""
        entry = self._running.pop(sid, None)
        self._paused.discard(sid)
        if entry is not None:
            self.committed_pages -= entry.pages
            return
        for entry in self._waiting:
            if entry.sid == sid:
                self._waiting.remove(entry)
                return
        raise NotFoundError(f"scheduler knows no stream {sid}")

    def pause(self, sid: int) -> None:
        """Leave a running stream out of the next plans (no-op for one that is not running)."""
        if sid in self._running:
            self._paused.add(sid)

    def resume(self, sid: int) -> None:
        self._paused.discard(sid)

    # ----- planning -----
    def schedule(self) -> list[Chunk]:
        """Plan the next forward and advance each planned stream's position."""
        budget = self.config.token_budget
        plan: list[Chunk] = []
        budget -= self._plan_decodes(plan)  # 1. decode tokens
        for e in self._running.values():  # 2. unfinished prompts
            if budget == 0:
                break
            if not e.decoding:
                budget -= self._plan_prefill(e, budget, plan)
        while budget > 0 and self._waiting and len(self._running) < self.config.max_batch:  # 3. admit
            head = self._waiting[0]
            if self.committed_pages + head.pages > self.config.num_pages:
                break
            budget -= self._plan_prefill(self._admit_head(), budget, plan)
        return plan

    def _plan_decodes(self, plan: list[Chunk]) -> int:
        """One decode token for every running stream whose prompt is done; returns how many."""
        n = 0
        paused = self._paused
        for e in self._running.values():
            if e.decoding and e.sid not in paused:
                assert e.computed + 1 <= e.max_tokens, f"stream {e.sid} ran past its {e.max_tokens} positions"
                plan.append(Chunk(e.sid, e.computed, 1, prefill=False, last_of_prompt=False))
                e.computed += 1
                n += 1
        return n

    def _admit_head(self) -> _Entry:
        """Move the queue head to running and commit its pages."""
        head = self._waiting.popleft()
        self._running[head.sid] = head
        self.committed_pages += head.pages
        return head

    @staticmethod
    def _plan_prefill(e: _Entry, budget: int, plan: list[Chunk]) -> int:
        n = min(e.prompt_len - e.computed, budget)
        plan.append(Chunk(e.sid, e.computed, n, prefill=True, last_of_prompt=e.computed + n == e.prompt_len))
        e.computed += n
        return n

    # ----- introspection -----
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_paused(self) -> int:
        return len(self._paused)

    def has_work(self) -> bool:
        """Something to plan: a waiting stream, or a running one that is not paused."""
        return bool(self._waiting) or len(self._running) > len(self._paused)

    def is_running(self, sid: int) -> bool:
        return sid in self._running
