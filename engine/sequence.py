"""One stream's state in the engine, from `Engine.add()` to its end (as nano-vllm's `Sequence`).

The engine, the scheduler and the model runner pass this one object around; nothing about a
stream lives in a map keyed by its id except the engine's index of live sequences (for `cancel`,
`pause` and `resume` by id). Plain Python: the scheduler's tests build sequences without torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from higgs_stream.engine.engine import StepEvent
    from higgs_stream.engine.family import FrameWriter, Prompt, Segment
    from higgs_stream.engine.request import GenerationRequest, SamplingParams

NEW, WAITING, RUNNING, FINISHED = "new", "waiting", "running", "finished"  # Sequence.status, in that order


@dataclass(eq=False)
class Sequence:
    """Everything the engine keeps about one stream."""

    sid: int
    request: GenerationRequest
    prompt: Prompt
    params: SamplingParams  # seed resolved
    max_frames: int  # effective cap (request's, lowered to fit the context length)
    segment: Segment  # the family's host rule machine (what the reference runner runs)
    writer: FrameWriter  # the stream's rows -> codec frames
    generator: torch.Generator | None = None  # the reference runner's sampling stream
    max_tokens: int = 0  # KV positions committed at admission (max_kv_tokens + the runner's slack)
    status: str = NEW
    # the scheduler's
    computed: int = 0  # positions already in the KV cache (or scheduled into it)
    pages: int = 0  # KV pages committed
    paused: bool = False  # a running sequence left out of decode plans
    # the engine's and the runner's resources
    holds_pages: bool = False  # the KV allocator holds pages for it
    slot: int | None = None  # its row in the device-side stream state (ModelRunner)
    outbox: deque[StepEvent] | None = None  # events for `Engine.stream()`, when it drives this one
    # the end
    reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def max_kv_tokens(self) -> int:
        """Positions this stream can ever occupy: the prompt plus every row but the last."""
        return self.prompt_len + self.max_frames + self.segment.k

    @property
    def decoding(self) -> bool:
        return self.computed >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status == FINISHED
