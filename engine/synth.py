"""Offline synthesis: request -> codec frames -> waveform, through the streaming engine.

The engine emits codec frames (each family's writer turns its rows into frames: for the Higgs
families REF's decode path, the delay pattern reverted and the BOS/EOS frames dropped, with stray
BOS/EOS replaced by the codebook's last valid code instead of clipped).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from higgs_stream.engine.engine import Engine
from higgs_stream.engine.request import GenerationRequest


class CodecLike(Protocol):
    def decode(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor: ...


def synthesize(engine: Engine, codec: CodecLike, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
    """(waveform float32 [F * hop], codec frames [K, F] int64) for one request."""
    frames = engine.generate(request)  # [K, F]
    wav = codec.decode(torch.from_numpy(frames)[None])[0]  # [F * hop]
    return wav.detach().float().cpu().numpy(), frames
