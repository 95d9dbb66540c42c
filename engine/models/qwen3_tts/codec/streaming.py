"""Exact stateful decoding of the causal 12 Hz tokenizer, many streams in one slot arena.

The same interface as engine/codec/streaming.py's `StreamingDecoder` (what stream/adapter.py's
`Code2Wav` and the codec worker drive): `open()` / `close(slot)`, `step(slots, codes, valid, final)
-> StepAudio`, `push(...)`, `widths` / `partition` / `step_cost`, `capture`, `geometry`.

The decoder is causal (look-ahead 0): a step of n frames yields exactly their n * hop samples, so a
stream's first PCM leaves with its first frame and a final push flushes nothing. State per stream
(decoder.QwenDecoder.state_shapes): pre_conv's last 2 frames, each transformer layer's K/V of the
last window-1 frames, and every later layer's input history. `states[i]` is [max_slots + 1, ...]
on the codec's device (the last slot is scratch for padding rows); a step gathers its rows' states by
slot, runs the stack once over [B, Q, C], and scatters the new states back. Row b advances by its
own valid[b] <= C frames: later columns are junk that no kept output or state reads (every layer is
causal and each new state is gathered at the row's own valid end). A stream at position 0 reads
zeros (no device work in `open`). Concatenated over any push schedule, a stream's samples equal
`QwenCodec.decode` of all its frames to fp32 rounding.

A step's inputs are one long tensor per (B, C) shape (codes [B, Q, C], then slot / valid / start [3, B];
engine/codec/step_graphs.py), written with one host-to-device copy; the step reads only it and the
arena (gather -> pre_conv -> sliding-window transformer -> upsampling and decoder -> scatter, updated in
place), with no host sync and no data-dependent shape. So `capture(..., graphs=True)` on a CUDA codec
records it once per (B, C) bucket as a CUDA graph and `step` replays it, exactly as the Higgs decoder:
each graph is checked against the eager step on random inputs (above CAPTURE_TOLERANCE of peak, all
graphs are dropped, logged, and steps run eagerly), and every bucket's replay is timed (`step_cost`).
The audio a step returns may be a view of a graph's output buffer: copy or convert it before the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from higgs_stream.engine.codec.arena import SlotArenaDecoder
from higgs_stream.engine.codec.step_graphs import (
    replay_diff,
    split_inputs,
)
from higgs_stream.engine.codec.streaming import StepAudio
from higgs_stream.engine.errors import InvalidInputError

if TYPE_CHECKING:
    from higgs_stream.engine.models.qwen3_tts.codec.codec import QwenCodec

# `partition` prices untimed steps with engine/codec/arena.py's STEP_* model (the Higgs decoder's fit: not
# measured for this decoder).


@dataclass
class _Stream:
    frames: int = 0  # frames pushed
    final: bool = False


class QwenStreamingDecoder(SlotArenaDecoder):
    STEP_FIELDS = 3  # slot, valid frames, start (the arena's staging)
    GRAPH_NAME = "Qwen3-TTS codec streaming"

    def __init__(self, codec: QwenCodec, max_slots: int) -> None:
        super().__init__(codec, max_slots, codec.decoder.state_shapes(), _Stream)

    def step(self, slots: Sequence[int], codes: torch.Tensor | np.ndarray, valid: Sequence[int],
             final: Sequence[bool]) -> StepAudio:
        """Advance each slot by valid[b] frames: row b's new samples are audio[b, :valid[b] * hop]."""
        codes, streams = self._check(slots, codes, valid, final)
        n = len(streams)
        width = max((int(v) for v in valid), default=0)
        hop = self.geometry.hop
        if width == 0:
            audio = torch.zeros((n, 0), dtype=torch.float32, device=self.device)
        else:
            audio = self._run(list(slots), codes, width, [int(v) for v in valid], [s.frames for s in streams])
        for s, v, f in zip(streams, valid, final):
            s.frames += int(v)
            s.final = bool(f)
        return StepAudio(audio, [0] * n, [int(v) * hop for v in valid])

    @staticmethod
    def _ended(stream: _Stream) -> bool:
        return stream.final

    def _math(self, inp: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
        """One batched step from the staged inputs: gathers the rows' states, runs the decoder, scatters the
        new states into the arena in place; returns audio [B, C * hop]. Capturable (no host sync)."""
        codes, (slot_idx, valid, start) = split_inputs(inp, key, self.geometry.num_codebooks)
        cols = torch.arange(key[1], device=inp.device)
        codes = torch.where((cols < valid[:, None])[:, None, :], codes, 0)  # junk columns -> a valid code
        fresh = start == 0
        states = []
        for s in self.states:
            rows = s.index_select(0, slot_idx)  # [B, ...]
            states.append(torch.where(fresh.view(-1, *([1] * (rows.dim() - 1))), 0.0, rows))
        audio, new = self.codec.decoder.step(codes, states, start, valid)  # [B, C * hop]
        for s, ns in zip(self.states, new):
            s.index_copy_(0, slot_idx, ns)
        return audio

    # ---- step planning (as engine/codec/streaming.py) ----
    def widths(self, slots: Sequence[int], valid: Sequence[int], final: Sequence[bool]) -> list[int]:
        """Frames each row runs through the stack (no flush: the decoder is causal)."""
        for slot in slots:
            if slot not in self._streams:
                raise InvalidInputError(f"codec stream slot {slot!r} is not open")
        return [int(v) for v in valid]

    def partition(self, slots: Sequence[int], valid: Sequence[int], final: Sequence[bool]) -> list[list[int]]:
        """Rows grouped into steps by width where that costs less than padding all to the widest."""
        widths = self.widths(slots, valid, final)
        order = sorted(range(len(widths)), key=widths.__getitem__)
        best = [0.0] + [float("inf")] * len(order)
        cut = [0] * (len(order) + 1)
        for j in range(1, len(order) + 1):
            for i in range(j):
                cost = best[i] + self.step_cost(j - i, widths[order[j - 1]])
                if cost < best[j]:
                    best[j], cut[j] = cost, i
        groups, j = [], len(order)
        while j > 0:
            groups.append(order[cut[j]:j])
            j = cut[j]
        return groups[::-1]

    def _check_graph(self, key: tuple[int, int], graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> float:
        """One replay vs the eager step from the same arena and inputs (random: some rows fresh, some
        mid-stream past the attention window, ragged valid frames)."""
        b, c = key
        gen = torch.Generator().manual_seed(b * 1000 + c)
        slots = list(range(b))
        codes = torch.randint(0, self.geometry.codebook_size, (b, self.geometry.num_codebooks, c), generator=gen)
        valid = torch.randint(0, c + 1, (b,), generator=gen).tolist()
        starts = (torch.randint(0, 3, (b,), generator=gen) * torch.randint(1, 100, (b,), generator=gen)).tolist()
        valid[0], starts[0] = c, 40  # row 0 mid-stream, all frames valid: real output in every bucket
        # random states of the b slots the step reads, drawn on the device (a full-size slot is ~5 MB)
        on_device = torch.Generator(self.device).manual_seed(b * 1000 + c)
        start_states = [torch.randn((b, *s.shape[1:]), generator=on_device, device=self.device).mul_(0.1)
                        for s in self.states]
        return replay_diff(self.states, start_states, b,
                           lambda: self._stage(self._inputs[key], key, slots, codes, valid, starts),
                           lambda: self._eager(key), lambda: (graph.replay(), output)[1])
