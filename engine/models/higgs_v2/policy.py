"""Per-stream generation state: REF's audio state machine, driven by sampled tokens.

One generated audio segment goes (research/higgs_v2_reference.md §3.5-3.6):

* AUDIO_INIT: the step whose input is <|audio_out_bos|> (the prompt's last token) yields a forced
  all-BOS column; the audio head is not used.
* Each later step samples a column (see sampling.py) and then, in REF's order:
  1. RAS: per codebook, if the sampled id occurs >= ras_max_repeat times among the last
     ras_window audio-out columns in context (prompt audio, the BOS column and forced BOS/EOS
     ids all count), take the RAS candidate instead (a draw from the raw logits; not re-checked).
     Applies in greedy mode too.
  2. frame cap (ours): at column max_frames + 1, if no ramp-out runs yet, codebook 0 is set to
     EOS, so the stream ends through the normal ramp-out after exactly max_frames frames.
  3. ramp-in: at column j = 1..7 codebooks >= j are BOS.
  4. ramp-out: the first column with an EOS starts a countdown from idx = the LOWEST codebook
     holding EOS (REF names it `last_eos_idx`, but `nonzero()[0][-1]` is the first match):
     codebooks < idx become EOS and K - idx - 1 columns follow, column m of them with
     codebooks < idx + m forced to EOS. When the countdown reaches 0 that column is the last one
     (REF then emits the <|audio_eos|> text token; nothing after it is needed for audio).
* A segment of L columns decodes to L - 9 frames (delay_pattern.DelayWriter, wrapped).

`SegmentState` is plain Python and knows nothing about models: the host oracle of the device
rules (device_rules.py). `V2Policy` is the family's `GenerationPolicy` (engine/family.py): prompt
builder, per-stream `Segment` (`V2Segment` wraps `SegmentState`: one column per call), the text id
of a decode step's input, and no sampling at the prompt's last position.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from higgs_stream.engine.family import Prompt, TokenizerLike
from higgs_stream.engine.models.delay_pattern import DelayWriter, stack_rows
from higgs_stream.engine.models.higgs_v2.config import TalkerConfig
from higgs_stream.engine.models.higgs_v2.prompt import build_prompt, check_transcript
from higgs_stream.engine.request import GenerationRequest, SamplingParams

Column = tuple[int, ...]  # one delay-pattern column: K ids in 0..codebook_size+1


class SegmentState:
    """Columns of one audio segment and REF's delay/EOS counters."""

    def __init__(
        self,
        num_codebooks: int = 8,
        codebook_size: int = 1024,
        *,
        max_frames: int,
        ras_window: int = 7,
        ras_max_repeat: int = 2,
        context_audio: np.ndarray | None = None,
    ) -> None:
        assert max_frames >= 1, f"max_frames must be >= 1, got {max_frames}"
        self.k = num_codebooks
        self.bos = codebook_size
        self.eos = codebook_size + 1
        self.cap_column = max_frames + 1
        self.ras_window = ras_window
        self.ras_max_repeat = ras_max_repeat
        # the last ras_window audio-out columns in context, oldest first
        self.window: deque[tuple[int, ...]] = deque(maxlen=max(ras_window, 1))
        if context_audio is not None and ras_window > 0:
            assert context_audio.shape[0] == num_codebooks, f"context audio must be [{num_codebooks}, A]"
            for col in context_audio[:, -ras_window:].T:
                self.window.append(tuple(int(x) for x in col))
        self.columns: list[tuple[int, ...]] = []
        self.num_delay = 0
        self.num_remaining: int | None = None
        self.finished = False
        self.reason: str | None = None
        self.num_ras_resampled = 0

    # ----- the two kinds of step -----
    def start(self) -> tuple[int, ...]:
        """AUDIO_INIT: the forced all-BOS column."""
        assert not self.columns, "start() begins a segment and is called once"
        return self._append([self.bos] * self.k)

    def advance(self, sampled: Sequence[int], ras_candidate: Sequence[int]) -> tuple[int, ...]:
        """One AUDIO_IN_PROGRESS step: sampled ids [K] (+ RAS candidates [K]) -> the emitted column."""
        assert self.columns and not self.finished, "advance() needs a started, unfinished segment"
        assert len(sampled) == self.k and len(ras_candidate) == self.k, "one id per codebook"
        tokens = [int(x) for x in sampled]
        self._apply_ras(tokens, ras_candidate)
        forced_stop = self.num_remaining is None and len(self.columns) >= self.cap_column
        if forced_stop:
            tokens[0] = self.eos
        if self.num_delay + 1 < self.k:  # ramp-in
            tokens[self.num_delay + 1 :] = [self.bos] * (self.k - self.num_delay - 1)
            self.num_delay += 1
        if self.num_remaining is not None:  # ramp-out countdown in progress
            tokens[: self.k - self.num_remaining] = [self.eos] * (self.k - self.num_remaining)
            self.num_remaining -= 1
        elif self.eos in tokens:  # ramp-out starts at the LOWEST codebook holding EOS (REF)
            idx = tokens.index(self.eos)
            tokens[:idx] = [self.eos] * idx
            self.num_remaining = self.k - idx - 1
            self.reason = "length" if forced_stop else "stop"
        if self.num_remaining is not None and self.num_remaining <= 0:
            self.finished = True
        return self._append(tokens)

    # ----- helpers -----
    def _apply_ras(self, tokens: list[int], candidate: Sequence[int]) -> None:
        if self.ras_window <= 0:
            return
        for k in range(self.k):
            repeats = sum(1 for col in self.window if col[k] == tokens[k])
            if repeats >= self.ras_max_repeat:
                tokens[k] = int(candidate[k])
                self.num_ras_resampled += 1

    def _append(self, tokens: list[int]) -> tuple[int, ...]:
        col = tuple(tokens)
        self.columns.append(col)
        if self.ras_window > 0:
            self.window.append(col)
        return col

    @property
    def last_column(self) -> tuple[int, ...]:
        return self.columns[-1]

    @property
    def num_frames(self) -> int:
        """Frames of the finished segment (columns - K - 1)."""
        return max(0, len(self.columns) - self.k - 1)

    def as_array(self) -> np.ndarray:
        """[K, L] int64 columns so far."""
        return stack_rows(self.columns, self.k)


class V2Segment:
    """`SegmentState` as the engine's `Segment` (engine/family.py): every sampled row emits exactly
    one column; AUDIO_INIT's forced all-BOS column is fed back but not emitted (the family's
    `DelayWriter` starts with it)."""

    def __init__(self, state: SegmentState) -> None:
        self.state = state
        self.k = state.k

    def start(self) -> list[Column]:
        self.state.start()  # AUDIO_INIT: the forced all-BOS column, the next step's input
        return []

    def advance(self, sampled: Sequence[int], ras_candidate: Sequence[int]) -> list[Column]:
        return [self.state.advance(sampled, ras_candidate)]

    @property
    def last_column(self) -> Column:
        return self.state.last_column

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def reason(self) -> str | None:
        return self.state.reason


class V2Policy:
    """Higgs Audio v2: REF's chat prompt ending in <|audio_out_bos|>, then one column per step.

    The prompt's last step is AUDIO_INIT (a forced all-BOS column, no sampling); every decode step
    feeds the previous column at an <|AUDIO_OUT|> position. Columns become codec frames through a
    wrapped `DelayWriter` (BOS and EOS frames dropped).
    """

    sample_at_prompt_end = False
    takes_history = True  # earlier segments as assistant audio turns
    speakers: tuple[str, ...] = ()

    def __init__(self, cfg: TalkerConfig, tokenizer: TokenizerLike) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.head_codebooks = cfg.num_codebooks  # the audio head samples whole columns

    def process_logits(self, logits: torch.Tensor, segments: Sequence[V2Segment]) -> torch.Tensor:
        """No logits processors: the rules (ramps, RAS) act on the sampled columns."""
        return logits

    def build_prompt(self, request: GenerationRequest) -> Prompt:
        return build_prompt(self.tokenizer, request, self.cfg.num_codebooks, self.cfg.codebook_size)

    def check_transcript(self, transcript: str) -> None:
        check_transcript(self.tokenizer, transcript, self.cfg.num_codebooks)

    def new_segment(self, prompt: Prompt, params: SamplingParams, max_frames: int) -> V2Segment:
        return V2Segment(SegmentState(self.cfg.num_codebooks, self.cfg.codebook_size, max_frames=max_frames,
                                      ras_window=params.ras_window, ras_max_repeat=params.ras_max_repeat,
                                      context_audio=prompt.audio_out))

    def new_writer(self) -> DelayWriter:
        return DelayWriter(self.cfg.num_codebooks, self.cfg.codebook_size, wrapped=True)
