"""Offline synthesis: request -> columns -> codec codes -> waveform, through the streaming engine.

The decode path is REF's (revert the delay pattern, drop the BOS and EOS frames) with stray
BOS/EOS replaced by the codebook's last valid code instead of clipped (delay.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from higgs_stream.engine.engine import Engine
from higgs_stream.engine.models.delay_pattern import columns_to_frames
from higgs_stream.engine.request import GenerationRequest


class CodecLike(Protocol):
    def decode(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor: ...


def synthesize(engine: Engine, codec: CodecLike, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
    """(waveform float32 [F * hop], delay-pattern columns [K, L] int64) for one request; F = L - K - 1."""
    columns = engine.generate(request)  # [K, L]
    frames = columns_to_frames(columns, codebook_size=engine.cfg.codebook_size)  # [K, F]
    wav = codec.decode(torch.from_numpy(frames)[None])[0]  # [F * hop]
    return wav.detach().float().cpu().numpy(), columns
