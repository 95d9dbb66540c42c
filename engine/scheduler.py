"""Admission and chunked-prefill scheduling under a token budget (plain Python, no torch).

Every step the scheduler plans one forward over `Sequence`s (engine/sequence.py):

1. every decoding sequence gets 1 token (its last row), oldest first: real-time streams never
   wait behind prefill;
2. sequences part-way through their prompt continue it, in admission order, with what is left of
   the token budget;
3. waiting sequences are admitted first-come first-served while a batch slot, budget and KV room
   remain; the queue head is never skipped (no starvation).

A decoding sequence can be paused (`pause`/`resume`): it keeps its pages and position and is left
out of the plan until resumed (the serving layer pauses streams far ahead of their listener).

KV room is committed at admission for the sequence's worst case (`Sequence.max_tokens`: prompt +
every row it may feed back + the runner's slack), so a running sequence can never run out of
pages mid-utterance and nothing is ever preempted. Pages themselves are reserved lazily, step by
step, inside that commitment.

`PrefillScheduler` (the model runner's) cuts prompts at multiples of a fixed chunk whatever else
runs, so a sequence's K/V do not depend on what shares its steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from higgs_stream.engine.errors import CapacityError, ConfigError, NotFoundError
from higgs_stream.engine.sequence import FINISHED, RUNNING, WAITING, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # sequences admitted at once (prefilling + decoding)
    token_budget: int = 2048  # tokens per forward (decode tokens + prefill chunks)
    max_waiting: int = 256  # queued sequences beyond which add() raises CapacityError
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
                f"decoding sequence gets its token each step"
            )

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + num_tokens) of one sequence run in this step."""

    seq: Sequence
    start: int
    num_tokens: int
    prefill: bool  # prompt tokens (else one decode token: the previous row)
    last_of_prompt: bool  # this chunk ends the prompt: the sequence's AUDIO_INIT step

    @property
    def sid(self) -> int:
        return self.seq.sid

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.committed_pages = 0
        self.num_paused = 0  # running sequences left out of decode plans

    # ----- queue management -----
    def add(self, seq: Sequence) -> None:
        """Queue a sequence (its `max_tokens` set); CapacityError when the queue is full or it can never fit."""
        cfg = self.config
        assert 1 <= seq.prompt_len <= seq.max_tokens, (
            f"need 1 <= prompt_len ({seq.prompt_len}) <= max_tokens ({seq.max_tokens})")
        pages = cfg.pages_for(seq.max_tokens)
        if pages > cfg.num_pages:
            raise CapacityError(f"stream needs {pages} KV pages at most, the cache has {cfg.num_pages}")
        if len(self.waiting) >= cfg.max_waiting:
            raise CapacityError(f"{len(self.waiting)} streams already waiting (max_waiting={cfg.max_waiting})")
        seq.pages, seq.status = pages, WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Forget a sequence (finished, cancelled or failed) and release its KV commitment."""
        if seq.status == RUNNING:
            self.running.remove(seq)
            self.committed_pages -= seq.pages
            self.resume(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        else:
            raise NotFoundError(f"scheduler knows no stream {seq.sid}")
        seq.status = FINISHED

    def pause(self, seq: Sequence) -> None:
        """Leave a running sequence out of the next plans (no-op for one that is not running)."""
        if seq.status == RUNNING and not seq.paused:
            seq.paused = True
            self.num_paused += 1

    def resume(self, seq: Sequence) -> None:
        if seq.paused:
            seq.paused = False
            self.num_paused -= 1

    # ----- planning -----
    def schedule(self) -> list[Chunk]:
        """Plan the next forward and advance each planned sequence's position."""
        budget = self.config.token_budget
        plan: list[Chunk] = []
        budget -= self._plan_decodes(plan)  # 1. decode tokens
        for s in self.running:  # 2. unfinished prompts
            if budget == 0:
                break
            if not s.decoding:
                budget -= self._plan_prefill(s, budget, plan)
        while budget > 0 and self.waiting and len(self.running) < self.config.max_batch:  # 3. admit
            head = self.waiting[0]
            if self.committed_pages + head.pages > self.config.num_pages:
                break
            budget -= self._plan_prefill(self._admit_head(), budget, plan)
        return plan

    def _plan_decodes(self, plan: list[Chunk]) -> int:
        """One decode token for every running sequence whose prompt is done; returns how many."""
        n = 0
        for s in self.running:
            if s.decoding and not s.paused:
                assert s.computed + 1 <= s.max_tokens, f"stream {s.sid} ran past its {s.max_tokens} positions"
                plan.append(Chunk(s, s.computed, 1, prefill=False, last_of_prompt=False))
                s.computed += 1
                n += 1
        return n

    def _admit_head(self) -> Sequence:
        """Move the queue head to running and commit its pages."""
        head = self.waiting.popleft()
        head.status = RUNNING
        self.running.append(head)
        self.committed_pages += head.pages
        return head

    @staticmethod
    def _plan_prefill(s: Sequence, budget: int, plan: list[Chunk]) -> int:
        n = min(s.prompt_len - s.computed, budget)
        plan.append(Chunk(s, s.computed, n, prefill=True, last_of_prompt=s.computed + n == s.prompt_len))
        s.computed += n
        return n

    # ----- introspection -----
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        """Something to plan: a waiting sequence, or a running one that is not paused."""
        return bool(self.waiting) or len(self.running) > self.num_paused

    def is_running(self, seq: Sequence) -> bool:
        return seq.status == RUNNING


class PrefillScheduler(Scheduler):
    """`Scheduler` whose prompt chunks depend on the prompt alone: a prompt is cut at multiples of
    `chunk` tokens, and a chunk waits for a step whose budget holds it whole (never split by the
    budget other sequences left). With chunk < token_budget - max_batch the oldest unfinished
    prompt always fits, so prefill cannot starve. `fold_first_decode`: a prompt's last chunk
    brings the sequence's first decode token into the same plan (a forced start row, e.g. Higgs
    v2's AUDIO_INIT column)."""

    def __init__(self, config: SchedulerConfig, chunk: int, fold_first_decode: bool = False) -> None:
        super().__init__(config)
        if not 1 <= chunk < config.token_budget - config.max_batch:
            raise ConfigError(f"prefill chunk {chunk} must be in 1..token_budget - max_batch - 1 "
                              f"({config.token_budget} - {config.max_batch} - 1)")
        self.chunk, self.fold = chunk, fold_first_decode

    def schedule(self) -> list[Chunk]:
        budget = self.config.token_budget
        plan: list[Chunk] = []
        budget -= self._plan_decodes(plan)  # 1. decode tokens
        for s in self.running:  # 2. unfinished prompts, oldest first
            if not s.decoding:
                if min(s.prompt_len - s.computed, self.chunk) > budget:
                    break
                budget -= self._chunk_of(s, plan)
        self._admit_waiting(budget, plan)  # 3. admit, queue head first
        return plan

    def admit_late(self, limit: int) -> list[Chunk]:
        """First chunks of up to `limit` waiting sequences, queue head first, for a launch of their own
        beside the steps in flight (ModelRunner's late prompts), under a budget of their own. Not for
        folding schedulers: a folded first decode token belongs to a step's decode rows."""
        if self.fold:
            raise ConfigError("a folding scheduler cannot admit prompts into a launch of their own")
        plan: list[Chunk] = []
        self._admit_waiting(self.config.token_budget, plan, limit)
        return plan

    def _admit_waiting(self, budget: int, plan: list[Chunk], limit: int | None = None) -> None:
        """Admit waiting sequences, queue head first, appending their first chunks to `plan`, while a batch
        slot, KV room and `budget` tokens remain (and fewer than `limit` sequences were admitted here)."""
        admitted = 0
        while self.waiting and len(self.running) < self.config.max_batch and (limit is None or admitted < limit):
            head = self.waiting[0]
            if self.committed_pages + head.pages > self.config.num_pages or min(head.prompt_len, self.chunk) > budget:
                break
            budget -= self._chunk_of(self._admit_head(), plan)
            admitted += 1

    def _chunk_of(self, s: Sequence, plan: list[Chunk]) -> int:
        n = min(s.prompt_len - s.computed, self.chunk)
        last = s.computed + n == s.prompt_len
        plan.append(Chunk(s, s.computed, n, prefill=True, last_of_prompt=last))
        s.computed += n
        if last and self.fold:
            plan.append(Chunk(s, s.computed, 1, prefill=False, last_of_prompt=False))
            s.computed += 1
            n += 1
        return n
