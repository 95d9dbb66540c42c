"""Higgs Audio v3 generation: the per-stream row state machine and the family's generation policy.

Generation (sglang-omni's sampler, `sglang_omni/models/higgs_tts/sampler.py`): the first row is
sampled from the hidden state at the prompt's final `<|audio|>`; every later step feeds
`<|audio|>` with the fused embedding of the previous row. Per row, all 8 codebooks are sampled
independently over all 1026 ids (no logit masking), then:

* ramp-up: at row r < 8, codebooks > r are overwritten with BOC (delays 0..7);
* from row 8 on, codebook 0 sampling EOC starts a countdown of 8 - 2 = 6 rows; the row where it
  reaches 0 is the last one. With EOC at row E the stream has E + 7 rows and decodes to exactly
  E frames: the last row completes frame E - 1, so no residual frame exists (vllm-omni counts 7,
  emits E + 8 rows and trims a residual frame; pinned in tests/engine/models/higgs_v3/test_policy.py).
* the frame cap ends a stream after max_frames + 7 rows (exactly max_frames complete frames).

The last row is never fed back. RAS is not applied (sglang-omni has none), so
SamplingParams.ras_* do not affect v3 streams.

Frames. Rows become codec frames through an unwrapped `delay_pattern.DelayWriter`: row r
completes frame r - 7, so R rows give R - 7 frames, every complete one. Stray BOC/EOC inside real
frames are replaced by the codebook's previous valid code like v2's; sglang-omni and vllm-omni
write 0 there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.family import Prompt, TokenizerLike
from higgs_stream.engine.models.delay_pattern import DelayWriter, stack_rows
from higgs_stream.engine.models.higgs_v3.config import TalkerV3Config
from higgs_stream.engine.models.higgs_v3.prompt import build_prompt_v3, check_transcript
from higgs_stream.engine.request import GenerationRequest, SamplingParams

# ----------------------------------------------------------------------------- state machine
class RowState:
    """sglang-omni's delay/EOC state machine for one stream (plain Python)."""

    def __init__(self, num_codebooks: int = 8, codebook_size: int = 1024, *, max_frames: int) -> None:
        assert num_codebooks >= 3, "the EOC countdown K - 2 needs K >= 3"
        assert max_frames >= 1, f"max_frames must be >= 1, got {max_frames}"
        self.k = num_codebooks
        self.boc, self.eoc = codebook_size, codebook_size + 1
        self.max_rows = max_frames + num_codebooks - 1
        self.rows: list[tuple[int, ...]] = []
        self.delay_count = 0  # rows produced inside the ramp-up window (0..K)
        self.eoc_countdown: int | None = None
        self.eoc_row: int | None = None  # row index where codebook 0 emitted EOC
        self.finished = False
        self.reason: str | None = None

    def advance(self, sampled: Sequence[int]) -> tuple[int, ...]:
        """Sampled ids [K] (0..1025) -> the row emitted for this step."""
        assert not self.finished, "advance() after the stream finished"
        assert len(sampled) == self.k, f"one id per codebook, got {len(sampled)}"
        row = [int(x) for x in sampled]
        if self.delay_count < self.k:  # ramp-up: codebooks > delay_count are not started yet
            row[self.delay_count + 1:] = [self.boc] * (self.k - self.delay_count - 1)
            self.delay_count += 1
        elif self.eoc_countdown is not None:
            self.eoc_countdown -= 1
            if self.eoc_countdown <= 0:
                self.finished, self.reason = True, "stop"
        elif row[0] == self.eoc:
            self.eoc_countdown = self.k - 2
            self.eoc_row = len(self.rows)
        self.rows.append(tuple(row))
        if not self.finished and len(self.rows) >= self.max_rows:
            self.finished, self.reason = True, "length"
        return tuple(row)

    @property
    def last_row(self) -> tuple[int, ...]:
        return self.rows[-1]

    @property
    def num_frames(self) -> int:
        """Complete frames in the rows so far (rows - K + 1)."""
        return max(0, len(self.rows) - self.k + 1)


class V3Segment:
    """A v3 stream's rows, for the engine (`engine/family.py` Segment).

    The engine calls `start()` at the prompt's last chunk (nothing to emit: v3 has no forced start
    row), then `advance()` once per sampled row (the first one on the same step); it returns [row].
    """

    def __init__(self, num_codebooks: int = 8, codebook_size: int = 1024, *, max_frames: int) -> None:
        self.state = RowState(num_codebooks, codebook_size, max_frames=max_frames)
        self.k = num_codebooks
        self.started = False

    def start(self) -> list[tuple[int, ...]]:
        assert not self.started, "start() begins the segment and is called once"
        self.started = True
        return []

    def advance(self, sampled: Sequence[int], ras_candidate: Sequence[int] | None = None) -> list[tuple[int, ...]]:
        """One sampled row -> [row]. `ras_candidate` is accepted for interface parity with the v2
        segment and ignored (no RAS in v3)."""
        assert self.started, "advance() before start()"
        return [self.state.advance(sampled)]

    @property
    def last_column(self) -> tuple[int, ...]:
        """The row the next step feeds back."""
        return self.state.last_row

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def reason(self) -> str | None:
        return self.state.reason

    @property
    def num_frames(self) -> int:
        return self.state.num_frames

    def as_array(self) -> np.ndarray:
        """[K, R] int64 rows so far."""
        return stack_rows(self.state.rows, self.k)


class V3Policy:
    """The engine's generation policy for v3 streams (engine/family.py GenerationPolicy)."""

    sample_at_prompt_end = True  # the prompt's last position yields row 0
    takes_history = True  # earlier segments join the reference slot
    speakers: tuple[str, ...] = ()

    def __init__(self, cfg: TalkerV3Config, tokenizer: TokenizerLike) -> None:
        if cfg.special is None:
            raise ConfigError("TalkerV3Config.special (the v3 token ids) must be set to build prompts")
        self.cfg, self.tokenizer, self.special = cfg, tokenizer, cfg.special
        self.head_codebooks = cfg.num_codebooks  # the fused audio head samples whole rows

    def process_logits(self, logits: torch.Tensor, segments: Sequence[V3Segment]) -> torch.Tensor:
        """No logits processors: the rules (ramp-up, EOC countdown) act on the sampled rows."""
        return logits

    @property
    def stop_ids(self) -> tuple[int, int]:
        return self.special.stop_ids

    def build_prompt(self, request: GenerationRequest) -> Prompt:
        return build_prompt_v3(self.tokenizer, self.special, request, self.cfg.num_codebooks, self.cfg.codebook_size)

    def check_transcript(self, transcript: str) -> None:
        check_transcript(self.tokenizer, self.special, transcript)

    def new_segment(self, prompt: Prompt, params: SamplingParams, max_frames: int) -> V3Segment:
        """The stream's segment (v3 has no RAS and no prompt-audio window: `prompt`/`params` unused)."""
        return V3Segment(self.cfg.num_codebooks, self.cfg.codebook_size, max_frames=max_frames)

    def new_writer(self) -> DelayWriter:
        return DelayWriter(self.cfg.num_codebooks, self.cfg.codebook_size, wrapped=False)
