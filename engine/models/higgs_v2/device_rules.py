"""Higgs Audio v2's row rules on the device: RAS, the frame cap and the delay-pattern ramps, applied
to every sampled row of a decode step exactly as `policy.SegmentState.advance` applies them on
the host (its test oracle: tests/engine/models/higgs_v2/test_device_rules.py).

Per slot the state (engine/gpu_sampling.DeviceStreamState) counts columns with the AUDIO_INIT
all-BOS column as column 0; the RAS window holds the last columns, the prompt's audio and that BOS
column included. Graph-capturable: fixed shapes, no host synchronisation.
"""

from __future__ import annotations

from typing import Any

import torch

from higgs_stream.engine.gpu_sampling import LENGTH, STOP, RowRules, commit_rows


class V2DeviceRules(RowRules):
    uses_ras = True

    @staticmethod
    def start_row(num_codebooks: int, codebook_size: int) -> tuple[int, ...]:
        """The all-BOS column (id codebook_size in every codebook)."""
        return (codebook_size,) * num_codebooks

    def cap(self, max_frames: int) -> int:
        """At column max_frames + 1 the frame cap forces EOS on codebook 0 (`SegmentState.cap_column`)."""
        return max_frames + 1

    fusible = True  # `rows` is integer-only (RowRules.fuse)

    def advance(self, state: Any, tokens: torch.Tensor, clean: torch.Tensor, noise: torch.Tensor,
                slots: torch.Tensor, live: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """SegmentState.advance for every row: tokens [B, K] -> packed [B, K + 1]."""
        candidate = (clean.softmax(dim=-1) / noise[:, 1]).argmax(dim=-1)  # [B, K], RAS's resample
        return self.rows(state, tokens, candidate, slots, live, finite)

    def rows(self, state: Any, tokens: torch.Tensor, candidate: torch.Tensor, slots: torch.Tensor,
             live: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """The rules past the float math (RAS's resample `candidate` [B, K] given): integers and booleans only."""
        k, bos, eos, cb = state.k, state.bos, state.eos, state._codebook
        # RAS over the last min(ras_window, fill) columns of the ring buffer
        ras_w, pos, fill = state.ras_window[slots], state.win_pos[slots], state.win_fill[slots]
        age = (pos[:, None] - 1 - state._age) % state.w  # [B, W]
        in_window = age < torch.minimum(ras_w, fill)[:, None]
        repeats = ((state.window[slots] == tokens[:, None, :]) & in_window[:, :, None]).sum(dim=1)  # [B, K]
        hit = (repeats >= state.ras_max_repeat[slots][:, None]) & (ras_w > 0)[:, None]
        tokens = torch.where(hit, candidate, tokens)

        # frame cap, ramp-in, ramp-out (SegmentState.advance, in the same order)
        remaining = state.num_remaining[slots]
        ncols = state.ncols[slots]
        forced_stop = (remaining < 0) & (ncols >= state.cap_column[slots])
        tokens[:, 0] = torch.where(forced_stop, eos, tokens[:, 0])
        delay = state.num_delay[slots]
        tokens = torch.where(cb > delay[:, None], bos, tokens)
        delay = torch.clamp(delay + 1, max=k - 1)
        counting = remaining >= 0
        tokens = torch.where(counting[:, None] & (cb < (k - remaining)[:, None]), eos, tokens)
        remaining = torch.where(counting, remaining - 1, remaining)
        is_eos = tokens == eos
        starts = ~counting & is_eos.any(dim=1)
        first = torch.where(is_eos, cb, k).amin(dim=1)  # lowest codebook holding EOS (k: none)
        tokens = torch.where(starts[:, None] & (cb < first[:, None]), eos, tokens)
        remaining = torch.where(starts, k - first - 1, remaining)
        reason = torch.where(starts, torch.where(forced_stop, LENGTH, STOP), state.stop_reason[slots])
        finished = (remaining >= 0) & (remaining <= 0)

        # write back (rows that did not advance keep their state)
        status, keep = commit_rows(state, slots, tokens, ncols, finished, reason, live, finite)
        advance = ~keep
        state.num_delay.index_copy_(0, slots, torch.where(keep, state.num_delay[slots], delay))
        state.num_remaining.index_copy_(0, slots, torch.where(keep, state.num_remaining[slots], remaining))
        state.stop_reason.index_copy_(0, slots, torch.where(keep, state.stop_reason[slots], reason))
        window = state.window[slots]  # [B, W, K]
        at = (state._age == pos[:, None]) & advance[:, None]  # [B, W]
        state.window.index_copy_(0, slots, torch.where(at[:, :, None], tokens[:, None, :], window))
        state.win_pos.index_copy_(0, slots, torch.where(advance, (pos + 1) % state.w, pos))
        state.win_fill.index_copy_(0, slots, torch.where(advance, torch.clamp(fill + 1, max=state.w), fill))
        return torch.cat([tokens, status[:, None]], dim=1)  # [B, K + 1]
