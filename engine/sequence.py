"""One stream's state in the engine: everything it keeps about a request from `add()` to its end."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from higgs_stream.engine.family import FrameWriter, Prompt, Segment
from higgs_stream.engine.request import GenerationRequest, SamplingParams


@dataclass
class Stream:
    """Everything the engine keeps about one stream."""

    sid: int
    request: GenerationRequest
    prompt: Prompt
    params: SamplingParams  # seed resolved
    max_frames: int  # effective cap (request's, lowered to fit the context length)
    generator: torch.Generator
    segment: Segment
    writer: FrameWriter  # the stream's rows -> codec frames
    reason: str | None = None  # why it finished: "stop" | "length" | "cancelled" | "error"
    error: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def max_kv_tokens(self) -> int:
        """Positions this stream can ever occupy: the prompt plus every column but the last."""
        return self.prompt_len + self.max_frames + self.segment.k
