"""The runner contract: what the engine (engine.py) calls per step, and what a step returns.

Two runners implement it, the way kernels/ keeps a plain `*_ref` beside each fast kernel: `ModelRunner`
(model_runner.py, the fast path) and `RefRunner` (ref_runner.py, the plain-torch reference)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from higgs_stream.engine.family import GenerationPolicy, Row
from higgs_stream.engine.gemv_choice import GemvChoice
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.scheduler import Chunk, Scheduler, SchedulerConfig
from higgs_stream.engine.sequence import Sequence

LateCall = Callable[[float], list[Chunk]]  # late(timeout_s): prompts arrived meanwhile, admitted and planned


class RowOut(NamedTuple):
    """What a step did for one sequence: the rows it emitted, in order, and its end if it ended."""

    seq: Sequence
    rows: list[Row]
    end: str | None = None  # "stop" | "length" | "error"
    error: str | None = None  # the message when end == "error"


class Runner(Protocol):
    """What the engine calls per step; `ModelRunner` (fast path) or `RefRunner` (plain torch)."""

    kv_slack: int  # KV positions a sequence may be scheduled for beyond `max_kv_tokens`
    wait_s: float  # host seconds spent waiting for the device so far (benchmarks)
    last_prefill: int  # prompt chunks in the last launched step (benchmarks)

    def make_scheduler(self, config: SchedulerConfig) -> Scheduler: ...

    def check(self, request: GenerationRequest) -> None: ...  # InvalidInputError for what it cannot serve

    def run(self, plan: list[Chunk], sync: bool = False, late: LateCall | None = None) -> list[RowOut]: ...
    # the rows that are ready (maybe a step late; sync: this step's own rows too, nothing left in flight;
    # late: prompts that arrive while the host waits, launched at once: `late_prompts` runners only)

    @property
    def busy(self) -> bool: ...  # results still in flight

    @property
    def in_flight(self) -> int: ...  # launches whose rows are not collected yet

    @property
    def late_prompts(self) -> bool: ...  # run() can take `late`

    def release(self, seq: Sequence) -> None: ...  # the sequence ended: free what the runner holds for it

    def gemv_choices(self) -> dict[str, GemvChoice]: ...  # engine/gemv_choice.py's, per FastTalker (none: {})


def samples_at(c: Chunk, policy: GenerationPolicy) -> bool:
    """Whether this chunk's last position is sampled: every decode step, and the prompt end if the
    family samples there."""
    return not c.prefill or (c.last_of_prompt and policy.sample_at_prompt_end)
