"""Qwen3-TTS's group-0 rules on the device: the reference's logits processors (ids >= codebook_size
suppressed except EOS, EOS held off for the first MIN_FRAMES frames, a repetition penalty over the
group-0 ids a stream emitted) and the stream's end (EOS in group 0: stop, without a frame; the frame
cap: length). Applied to every sampled row exactly as `policy.QwenPolicy.process_logits` and
`policy.QwenSegment.advance` apply them on the host (their test oracle:
tests/engine/models/qwen3_tts/test_device_rules.py). No RAS.

Per slot the state (engine/gpu_sampling.DeviceStreamState) counts columns from 1 at the prompt's
end, so a stream has emitted `ncols - 1` frames before a row (the counter-based noise is keyed on
it); the rules keep one more per-slot tensor, `seen` [slots, vocab] (the group-0 ids emitted).
A row that ends the stream at EOS keeps EOS in group 0 (the frame writer drops it) and whatever
the code predictor wrote for the rest. Graph-capturable: fixed shapes, no host synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch

from higgs_stream.engine.gpu_sampling import LENGTH, STOP, RowRules, commit_rows
from higgs_stream.engine.models.qwen3_tts.config import QwenTTSConfig
from higgs_stream.engine.models.qwen3_tts.generate import MIN_FRAMES


class QwenDeviceRules(RowRules):
    uses_ras = False

    def __init__(self, cfg: QwenTTSConfig) -> None:
        self.codebook_size, self.vocab, self.eos = cfg.codebook_size, cfg.vocab_size, cfg.codec_eos_id
        self.penalty = cfg.generation.repetition_penalty
        self.seen: torch.Tensor | None = None  # [slots, vocab] bool, allocated by attach()

    def attach(self, state: Any) -> None:
        assert state.v == self.vocab, f"the state samples {state.v} ids, group 0 has {self.vocab}"
        dev = state.device
        self.seen = torch.zeros((state.last_col.shape[0], self.vocab), dtype=torch.bool, device=dev)
        ids = torch.arange(self.vocab, device=dev)
        self._special = ids >= self.codebook_size  # [V]
        self._is_eos = ids == self.eos  # [V]

    def start(self, state: Any, slots: torch.Tensor) -> None:
        self.seen.index_fill_(0, slots, False)  # graph-capturable (DeviceStreamState.capture_start)

    @staticmethod
    def start_row(num_codebooks: int, codebook_size: int) -> tuple[int, ...]:
        """Never fed back (the prompt's end is sampled): zeros, valid ids of every group's table."""
        return (0,) * num_codebooks

    def cap(self, max_frames: int) -> int:
        """The row at column max_frames is the last frame (`QwenSegment`: frames >= max_frames)."""
        return max_frames

    def process(self, state: Any, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`QwenPolicy.process_logits` for every row: group 0's logits [B, 1, V] -> the same, processed."""
        g = logits[:, 0]  # [B, V]
        if self.penalty != 1.0:
            g = torch.where(self.seen[slots], torch.where(g < 0, g * self.penalty, g / self.penalty), g)
        hold_eos = state.ncols[slots] - 1 < MIN_FRAMES  # [B]: frames emitted so far < MIN_FRAMES
        suppress = self._special[None] & ~(self._is_eos[None] & ~hold_eos[:, None])  # [B, V]
        return g.masked_fill(suppress, float("-inf"))[:, None]

    def advance(self, state: Any, tokens: torch.Tensor, clean: torch.Tensor, noise: torch.Tensor,
                slots: torch.Tensor, live: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """`QwenSegment.advance` for every row: whole rows [B, 16] -> packed [B, 17]."""
        ncols = state.ncols[slots]
        first = tokens[:, 0]
        stop = first == self.eos
        length = ~stop & (ncols >= state.cap_column[slots])  # this row is frame `ncols`
        finished = stop | length

        status, keep = commit_rows(state, slots, tokens, ncols, finished, torch.where(stop, STOP, LENGTH), live, finite)
        emitted = ~keep & ~stop  # [B]: a frame, whose group-0 id the penalty sees from now on
        self.seen[slots, first] = self.seen[slots, first] | emitted
        return torch.cat([tokens, status[:, None]], dim=1)  # [B, K + 1]
