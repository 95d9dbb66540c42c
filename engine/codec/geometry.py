"""What the streaming side needs to know about a codec: frame layout and how far its decoder looks ahead.

`CodecGeometry` describes any frame codec in six numbers and one flag, so the adapters and the
incremental decoder never special-case a model family:

- Higgs v2 (non-causal DAC decoder): 8 x 1024 codes, hop 960 at 24 kHz, a sliding window needs 10
  frames each side, and an incremental decoder lags the pushed frames by 9458 samples (9.85 frames);
- a causal codec such as Qwen3-TTS's 12 Hz tokenizer: 16 codebooks, hop 1920, look-ahead 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from higgs_stream.engine.errors import ConfigError


@dataclass(frozen=True)
class CodecGeometry:
    num_codebooks: int  # Q: code rows per frame
    codebook_size: int  # codes are 0..codebook_size-1
    hop: int  # output samples per frame
    sample_rate: int  # output samples per second
    receptive_field: int  # frames of context a sliding-window decode needs on each side (left side for a causal codec)
    lookahead_samples: int  # output samples an incremental decoder lags behind the frames pushed into it
    causal: bool  # no output sample depends on a later frame (then lookahead_samples == 0)

    def __post_init__(self) -> None:
        for name in ("num_codebooks", "codebook_size", "hop", "sample_rate"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"codec geometry: {name} must be a positive int, got {v!r}")
        for name in ("receptive_field", "lookahead_samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"codec geometry: {name} must be a non-negative int, got {v!r}")
        if not isinstance(self.causal, bool):
            raise ConfigError(f"codec geometry: causal must be a bool, got {self.causal!r}")
        if self.causal != (self.lookahead_samples == 0):
            raise ConfigError(f"codec geometry: a {'causal' if self.causal else 'non-causal'} codec cannot have "
                              f"lookahead_samples={self.lookahead_samples} (causal means no look-ahead)")

    # ---- derived values (never stored) ----
    @property
    def lookahead_frames(self) -> int:
        """Frames that must follow a frame before all of its samples are final (flush length at the end)."""
        return math.ceil(self.lookahead_samples / self.hop)

    @property
    def frame_seconds(self) -> float:
        return self.hop / self.sample_rate
