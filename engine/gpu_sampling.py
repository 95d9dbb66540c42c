"""Per-stream generation state on the device and one batched sample-and-advance per decode step.

`DeviceStreamState` holds, per slot (one slot per decoding stream), everything a family's host
rule machine keeps in Python (Higgs v2: `models/higgs_v2/policy.SegmentState`): the last row (the
next step's input), the column count, the ramp counters, the RAS window, and the stream's sampling
parameters and seed. A decode step then needs no host round trip: `sample_and_advance(logits,
slots, valid)` samples every row, applies the family's row rules (`rules`, a
`family.DeviceRules` from `models/<family>/device_rules.py`, each kept equal to its host machine by
tests), writes the state back and returns one packed [B, K + 1] tensor (the new rows and a status
per row) for a single asynchronous copy to the host.

Sampling follows engine/sampling.py (same warpers, same exponential race, greedy = argmax of the
raw logits), but the noise is counter-based (kernels/sampling_noise.py): row b's draws depend only
on (seed, column index), so a stream's codes do not depend on what shares its batch. Sampled codes
therefore differ from the CPU engine's generator stream; greedy codes are the same function of the
logits. Slots >= `num_slots` are scratch rows for padded batch entries. Columns are counted from
the AUDIO_INIT column (column 0): a stream's first sampled row is column 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from higgs_stream.engine.device_copy import upload
from higgs_stream.engine.family import DeviceRules
from higgs_stream.engine.request import SamplingParams
from higgs_stream.engine.sampling import SamplingTensors, warp_logits
from higgs_stream.kernels import sampling_noise

# status column of the packed output
RUNNING, STOP, LENGTH, ERROR, IGNORED = 0, 1, 2, 3, 4
STATUS_REASON = {STOP: "stop", LENGTH: "length"}


@dataclass(frozen=True)
class StreamStart:
    """What the device state needs when a stream reaches AUDIO_INIT."""

    slot: int
    params: SamplingParams  # seed resolved
    max_frames: int
    context_audio: np.ndarray  # [K, A] int64, the prompt's audio-out columns (RAS window seed)


class DeviceStreamState:
    def __init__(self, num_slots: int, scratch_slots: int, num_codebooks: int, codebook_size: int,
                 device: torch.device, rules: DeviceRules, ras_window_max: int = 16,
                 fast_noise: bool | None = None) -> None:
        s, k = num_slots + scratch_slots, num_codebooks
        self.rules = rules
        self.num_slots, self.k, self.v = num_slots, k, codebook_size + 2
        self.bos, self.eos = codebook_size, codebook_size + 1
        self.w = ras_window_max
        self.device = torch.device(device)
        self.fast_noise = self.device.type == "cuda" if fast_noise is None else fast_noise

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.last_col = zeros(s, k)  # the column fed back next step
        self.ncols = zeros(s)  # columns emitted so far (the BOS column included)
        self.num_delay = zeros(s)
        self.num_remaining = zeros(s) - 1  # -1: no ramp-out yet
        self.stop_reason = zeros(s) + STOP  # STOP, or LENGTH when the frame cap started the ramp-out
        self.done = torch.ones(s, dtype=torch.bool, device=self.device)  # free or finished
        self.cap_column = zeros(s)
        self.window = zeros(s, self.w, k)  # ring buffer of the last columns
        self.win_pos = zeros(s)
        self.win_fill = zeros(s)
        self.ras_window = zeros(s)
        self.ras_max_repeat = zeros(s) + 1
        self.seed = zeros(s)
        self.temperature = torch.ones(s, device=self.device)
        self.top_k = zeros(s) + self.v
        self.top_p_cut = zeros(s, dtype=torch.float32) - 1.0
        self.greedy = zeros(s, dtype=torch.bool)
        self._codebook = torch.arange(k, device=self.device)[None]  # [1, K]
        self._age = torch.arange(self.w, device=self.device)[None]  # [1, W]

    # ------------------------------------------------------------------ host -> device (AUDIO_INIT)
    def start(self, starts: Sequence[StreamStart]) -> None:
        """Reset the slots of streams that reach AUDIO_INIT: their start row (the family's; Higgs:
        the all-BOS column) is emitted now."""
        if not starts:
            return
        if not self.rules.uses_ras:  # no window, whatever the request says
            starts = [replace(st, params=replace(st.params, ras_window=0)) for st in starts]
        for st in starts:
            assert 0 <= st.slot < self.num_slots, f"slot {st.slot} outside [0, {self.num_slots})"
            if st.params.ras_window > self.w:
                raise ValueError(f"ras_window {st.params.ras_window} exceeds the device window {self.w}")
        n, k, w = len(starts), self.k, self.w
        window = np.zeros((n, w, k), np.int64)
        fill = np.zeros(n, np.int64)
        start_row = np.array(self.rules.start_row(k, self.bos), np.int64)  # [K], the family's (Higgs: all BOS)
        for i, st in enumerate(starts):  # context audio (last ras_window columns), then the start row
            r = st.params.ras_window
            ctx = st.context_audio[:, max(0, st.context_audio.shape[1] - r):].T if r > 0 else np.zeros((0, k), np.int64)
            cols = np.concatenate([ctx, start_row[None]])[-w:]
            window[i, : len(cols)] = cols
            fill[i] = len(cols)
        slots = upload([st.slot for st in starts], self.device, torch.long)
        ints = upload(np.stack([
            fill % w, fill, [st.params.ras_window for st in starts], [st.params.ras_max_repeat for st in starts],
            [st.params.seed for st in starts], [self.rules.cap(st.max_frames) for st in starts],
            [min(st.params.top_k, self.v) if st.params.top_k else self.v for st in starts],
        ]), self.device, torch.long)  # [7, n]
        floats = upload([[st.params.temperature if not st.params.greedy else 1.0 for st in starts],
                         [1.0 - st.params.top_p if st.params.top_p < 1.0 else -1.0 for st in starts]],
                        self.device, torch.float32)  # [2, n]
        self.window[slots] = upload(window, self.device)
        for row, name in enumerate(("win_pos", "win_fill", "ras_window", "ras_max_repeat", "seed", "cap_column", "top_k")):
            getattr(self, name)[slots] = ints[row]
        self.temperature[slots] = floats[0]
        self.top_p_cut[slots] = floats[1]
        self.greedy[slots] = upload([st.params.greedy for st in starts], self.device, torch.bool)
        self.last_col[slots] = upload(start_row, self.device)
        self.ncols[slots] = 1
        self.num_delay[slots] = 0
        self.num_remaining[slots] = -1
        self.stop_reason[slots] = STOP
        self.done[slots] = False

    def release(self, slot: int) -> None:
        self.done[slot] = True

    # ------------------------------------------------------------------ the decode-step tail
    def noise(self, slots: torch.Tensor) -> torch.Tensor:
        """[B, 2, K, V] Exp(1) noise of these slots' current column (sampling | RAS candidate)."""
        n = 2 * self.k * self.v
        fn = sampling_noise.exp_noise if self.fast_noise else sampling_noise.exp_noise_ref
        return fn(self.seed[slots], self.ncols[slots], n).view(-1, 2, self.k, self.v)

    def sample_and_advance(self, logits: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """logits [B, K, V] fp32, slots [B] long, valid [B] bool -> packed [B, K + 1] long
        (the emitted column, then RUNNING/STOP/LENGTH/ERROR, or IGNORED for invalid/finished rows).

        Graph-capturable: fixed shapes, no host synchronisation.
        """
        live = valid & ~self.done[slots]  # [B]
        finite = torch.isfinite(logits).all(dim=2).all(dim=1)  # [B]
        clean = torch.where(finite[:, None, None], logits, torch.zeros_like(logits))
        st = SamplingTensors(temperature=self.temperature[slots], top_k=self.top_k[slots],
                             top_p_cut=self.top_p_cut[slots], greedy=self.greedy[slots],
                             use_top_k=True, use_top_p=True)
        noise = self.noise(slots)  # [B, 2, K, V]
        probs = warp_logits(clean, st).softmax(dim=-1)
        sampled = (probs / noise[:, 0]).argmax(dim=-1)  # [B, K]
        tokens = torch.where(st.greedy[:, None], clean.argmax(dim=-1), sampled)  # [B, K]
        return self.rules.advance(self, tokens, clean, noise, slots, live, finite)  # the family's row rules
