"""Higgs Audio v3's row rules on the device (sglang-omni's sampler): ramp-up with BOC, the stream
ends K - 2 rows after codebook 0 emits EOC from row K on, or after max_frames + K - 1 rows; no
RAS. Applied to every sampled row exactly as `policy.RowState.advance` applies them on the host
(its test oracle: tests/engine/models/higgs_v3/test_device_rules.py).

Per slot the state (engine/gpu_sampling.DeviceStreamState) counts columns with the AUDIO_INIT
column as column 0, so row r is column r + 1 (the counter-based sampling noise is keyed on it).
Graph-capturable: fixed shapes, no host synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch

from higgs_stream.engine.gpu_sampling import LENGTH, STOP, RowRules, commit_rows


class V3DeviceRules(RowRules):
    uses_ras = False  # the state's RAS window stays empty whatever the request asks

    def __init__(self, num_codebooks: int) -> None:
        self.k = num_codebooks

    @staticmethod
    def start_row(num_codebooks: int, codebook_size: int) -> tuple[int, ...]:
        """The all-BOS column (id codebook_size in every codebook)."""
        return (codebook_size,) * num_codebooks

    def cap(self, max_frames: int) -> int:
        """The frame cap in rows: max_frames + K - 1 (`RowState.max_rows`)."""
        return max_frames + self.k - 1

    fusible = True  # `rows` is integer-only (RowRules.fuse)

    def advance(self, state: Any, tokens: torch.Tensor, clean: torch.Tensor, noise: torch.Tensor,
                slots: torch.Tensor, live: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """RowState.advance for every row (same order): tokens [B, K] -> packed [B, K + 1]."""
        return self.rows(state, tokens, None, slots, live, finite)

    def rows(self, state: Any, tokens: torch.Tensor, candidate: torch.Tensor | None, slots: torch.Tensor,
             live: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """The rules (no RAS: `candidate` unused): integers and booleans only."""
        k, bos, eos = state.k, state.bos, state.eos
        ncols, delay, remaining = state.ncols[slots], state.num_delay[slots], state.num_remaining[slots]
        ramp = delay < k  # row `delay` of the ramp-up: codebooks > delay are not started yet
        tokens = torch.where(ramp[:, None] & (state._codebook > delay[:, None]), bos, tokens)
        counting = ~ramp & (remaining >= 0)
        remaining = torch.where(counting, remaining - 1, remaining)
        stop = counting & (remaining <= 0)
        starts = ~ramp & ~counting & (tokens[:, 0] == eos)
        remaining = torch.where(starts, k - 2, remaining)
        length = ~stop & (ncols >= state.cap_column[slots])  # rows after this one == ncols
        finished = stop | length

        status, keep = commit_rows(state, slots, tokens, ncols, finished, torch.where(stop, STOP, LENGTH), live, finite)
        state.num_delay.index_copy_(0, slots, torch.where(keep | ~ramp, delay, delay + 1))
        state.num_remaining.index_copy_(0, slots, torch.where(keep, state.num_remaining[slots], remaining))
        return torch.cat([tokens, status[:, None]], dim=1)  # [B, K + 1]
