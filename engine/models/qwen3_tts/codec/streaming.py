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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.codec.streaming import StepAudio
from higgs_stream.engine.errors import CapacityError, ConfigError, InvalidInputError

if TYPE_CHECKING:
    from higgs_stream.engine.models.qwen3_tts.codec.codec import QwenCodec

log = logging.getLogger(__name__)

# Step cost model (seconds) for `partition`: fixed + per row + per row-frame (not yet measured on a GPU:
# the Higgs decoder's fit, engine/codec/streaming.py, scaled by nothing).
STEP_FIXED_S, STEP_ROW_S, STEP_ROW_FRAME_S = 2.0e-3, 0.11e-3, 0.027e-3


@dataclass
class _Stream:
    frames: int = 0  # frames pushed
    final: bool = False


class QwenStreamingDecoder:
    def __init__(self, codec: QwenCodec, max_slots: int) -> None:
        if not isinstance(max_slots, int) or isinstance(max_slots, bool) or max_slots < 1:
            raise ConfigError(f"max_slots must be a positive int, got {max_slots!r}")
        self.codec = codec
        self.geometry: CodecGeometry = codec.geometry
        self.max_slots = max_slots
        self.scratch = max_slots
        self.device = codec.device
        self.states = [torch.zeros((max_slots + 1, *shape), device=self.device)
                       for shape in codec.decoder.state_shapes()]
        self._streams: dict[int, _Stream] = {}
        self._free = list(range(max_slots - 1, -1, -1))
        self._buckets: list[tuple[int, int]] = []
        self.capture_check: float | None = None
        self.replays = 0
        self.timings: dict[tuple[int, int], float] = {}

    # ---- slots ----
    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def state_bytes_per_stream(self) -> int:
        return sum(s[0].numel() * s.element_size() for s in self.states)

    def open(self) -> int:
        if not self._free:
            raise CapacityError(f"all {self.max_slots} codec stream slots are in use")
        slot = self._free.pop()
        self._streams[slot] = _Stream()
        return slot

    def close(self, slot: int) -> None:
        if slot not in self._streams:
            raise InvalidInputError(f"codec stream slot {slot!r} is not open")
        del self._streams[slot]
        self._free.append(slot)

    # ---- decode ----
    def push(self, slots: Sequence[int], codes: torch.Tensor | np.ndarray, valid: Sequence[int],
             final: Sequence[bool]) -> list[torch.Tensor]:
        out = self.step(slots, codes, valid, final)
        return [out.audio[i, o:o + c] for i, (o, c) in enumerate(zip(out.offsets, out.counts))]

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
            b, c = self._bucket(n, width) or (n, width)
            audio = self._run(list(slots), codes, [int(v) for v in valid], [s.frames for s in streams], b, c)
        for s, v, f in zip(streams, valid, final):
            s.frames += int(v)
            s.final = bool(f)
        return StepAudio(audio, [0] * n, [int(v) * hop for v in valid])

    def _check(self, slots, codes, valid, final) -> tuple[torch.Tensor, list[_Stream]]:
        n = len(slots)
        if len(valid) != n or len(final) != n:
            raise InvalidInputError(f"slots, valid and final differ in length ({n}, {len(valid)}, {len(final)})")
        codes = torch.as_tensor(codes)
        q = self.geometry.num_codebooks
        if codes.dim() != 3 or codes.shape[0] != n or codes.shape[1] != q:
            raise InvalidInputError(f"codes must be [{n}, {q}, C], got {tuple(codes.shape)}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise InvalidInputError(f"codes must be integers, got {codes.dtype}")
        if len(set(slots)) != n:
            raise InvalidInputError(f"slots repeat in one push: {list(slots)}")
        streams = []
        for slot, v in zip(slots, valid):
            s = self._streams.get(slot)
            if s is None:
                raise InvalidInputError(f"codec stream slot {slot!r} is not open")
            if s.final:
                raise InvalidInputError(f"codec stream slot {slot} was pushed after its final frames")
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 0 <= v <= codes.shape[2]:
                raise InvalidInputError(f"valid must be ints in 0..{codes.shape[2]}, got {v!r}")
            streams.append(s)
        w = max((int(v) for v in valid), default=0)
        if w:
            part = codes[:, :, :w]
            real = torch.arange(w, device=codes.device) < torch.as_tensor(list(valid), device=codes.device)[:, None]
            bad = ((part < 0) | (part >= self.geometry.codebook_size)) & real[:, None, :]
            if bool(bad.any()):
                raise InvalidInputError(f"codes must lie in 0..{self.geometry.codebook_size - 1}")
        return codes, streams

    def _run(self, slots: list[int], codes: torch.Tensor, valid: list[int], starts: list[int], b: int,
             c: int) -> torch.Tensor:
        """One batched step at shape [b, Q, c] (rows beyond len(slots) are scratch padding)."""
        n, q = len(slots), self.geometry.num_codebooks
        batch = torch.zeros((b, q, c), dtype=torch.long)
        w = min(codes.shape[2], c)
        batch[:n, :, :w] = codes[:, :, :w].to("cpu", torch.long)
        cols = torch.arange(c)
        v = torch.tensor(valid + [0] * (b - n), dtype=torch.long)
        batch = torch.where((cols < v[:, None])[:, None, :], batch, 0)  # junk columns -> a valid code
        slot_idx = torch.tensor(slots + [self.scratch] * (b - n), dtype=torch.long, device=self.device)
        start = torch.tensor(starts + [0] * (b - n), dtype=torch.long, device=self.device)
        v = v.to(self.device)
        fresh = start == 0
        with torch.no_grad(), self.codec.precision():
            states = []
            for s in self.states:
                rows = s.index_select(0, slot_idx)
                states.append(torch.where(fresh.view(-1, *([1] * (rows.dim() - 1))), 0.0, rows))
            audio, new = self.codec.decoder.step(batch.to(self.device), states, start, v)
            for s, ns in zip(self.states, new):
                s.index_copy_(0, slot_idx, ns)
        return audio[:n]

    # ---- step planning (as engine/codec/streaming.py) ----
    def _bucket(self, n: int, width: int) -> tuple[int, int] | None:
        fits = [k for k in self._buckets if k[0] >= n and k[1] >= width]
        return min(fits, key=lambda k: (k[0] * k[1], k)) if fits else None

    def step_cost(self, n: int, width: int) -> float:
        b, c = self._bucket(n, width) or (n, width)
        return STEP_FIXED_S + b * (STEP_ROW_S + c * STEP_ROW_FRAME_S)

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

    def capture(self, batch_buckets: Sequence[int], frame_buckets: Sequence[int], graphs: bool = True,
                stream: torch.cuda.Stream | None = None) -> float:
        """Pad steps to (B, C) buckets. CUDA graphs of this decoder are not built yet: with `graphs` on a
        CUDA codec the steps run eagerly at the bucket shapes (logged), never silently approximate.
        `stream`: the Higgs decoder's signature (where to capture); nothing is captured here."""
        for bb in batch_buckets:
            if not isinstance(bb, int) or not 1 <= bb <= self.max_slots:
                raise ConfigError(f"batch buckets must be ints in 1..max_slots={self.max_slots}, got {bb!r}")
        for c in frame_buckets:
            if not isinstance(c, int) or c < 1:
                raise ConfigError(f"frame buckets must be positive ints, got {c!r}")
        if graphs and self.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA codec, it is on {self.device}")
        if graphs:
            log.warning("the Qwen3-TTS stateful decoder has no CUDA graphs yet; its steps run eagerly")
        self._buckets = sorted({(bb, c) for bb in batch_buckets for c in frame_buckets})
        self.capture_check = 0.0
        return 0.0

    @property
    def graphed(self) -> bool:
        return False
