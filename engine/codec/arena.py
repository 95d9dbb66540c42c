"""What both stateful streaming decoders share (the Higgs codec's, engine/codec/streaming.py, and the
Qwen3-TTS 12 Hz codec's, engine/models/qwen3_tts/codec/streaming.py): the slot arena (per-stream state
tensors [max_slots + 1, ...], the last slot scratch for padding rows) and its bookkeeping, the
padded-step buckets and their CUDA graphs (`capture`, `_run`: staging, graph-or-eager step, replay
timings, with engine/codec/step_graphs.py), and the step cost model `partition` prices steps with. A
decoder brings its layer math (`_math`, `_check_graph`), its per-row step fields (STEP_FIELDS: slot
first) and its push bookkeeping (`step`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from higgs_stream.engine.codec.convs import codec_convs
from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.codec.step_graphs import (
    bucket_keys,
    capture_checked,
    checked_replays,
    input_size,
    replay_seconds,
    smallest_bucket,
    stage_inputs,
)
from higgs_stream.engine.errors import CapacityError, ConfigError, InvalidInputError

# Step cost model (seconds) where no replay was timed (CPU, eager shapes): fixed + per row + per row-frame.
# Fitted to the Higgs decoder's graphed steps on an H200 (bench_codec: B=1..128 x 1..25 frames).
STEP_FIXED_S, STEP_ROW_S, STEP_ROW_FRAME_S = 2.0e-3, 0.11e-3, 0.027e-3
# What an eager step at a shape no bucket holds costs a GPU decoder beyond that model (its ~300 kernel launches, the
# convolutions' first-use plans): at least this. H200 traces (session 30): one-row steps of 43-69 frames took 14-86
# ms where the model says 4-6 (stream/adapter.py's Code2Wav weighs it against bucketed pieces).
STEP_EAGER_S = 10e-3

Key = tuple[int, int]  # (B rows, C frames)
NATIVE_CHECK_ROW_FRAMES = 64  # check_against_native: buckets of at most this many rows x frames


class SlotArenaDecoder:
    """Base of a stateful streaming decoder: `open()` a slot per stream, `push`/`step` its frames
    (the subclass's `step`), `close(slot)`. `new_stream()` makes a slot's host-side bookkeeping."""

    STEP_FIELDS = 3  # per-row int fields of a step's inputs after the codes: slot, then the decoder's own
    GRAPH_NAME = "codec streaming"  # how capture's log names this decoder

    def __init__(self, codec: Any, max_slots: int, state_shapes: Sequence[tuple[int, ...]],
                 new_stream: Callable[[], Any]) -> None:
        if not isinstance(max_slots, int) or isinstance(max_slots, bool) or max_slots < 1:
            raise ConfigError(f"max_slots must be a positive int, got {max_slots!r}")
        self.codec = codec
        self.geometry: CodecGeometry = codec.geometry
        self.max_slots = max_slots
        self.scratch = max_slots  # padding rows read and write this slot
        self.device = codec.device
        self.states = [torch.zeros((max_slots + 1, *shape), device=self.device) for shape in state_shapes]
        self._new_stream = new_stream
        self._streams: dict[int, Any] = {}
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self._buckets: list[Key] = []  # (B, C) step shapes, set by capture()
        self._graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self._inputs: dict[Key, torch.Tensor] = {}  # static inputs per bucket (graphs only)
        self._outputs: dict[Key, torch.Tensor] = {}  # the graphs' audio [B, C * hop]
        self.capture_check: float | None = None  # max |d| / peak of graph replay vs eager, once captured
        self.replays = 0
        self.timings: dict[Key, float] = {}  # (B, C) bucket -> seconds per replay (capture)
        self._native_reference = False  # `_eager` on PyTorch's native convolutions (check_against_native)

    # ---- slots ----
    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def state_bytes_per_stream(self) -> int:
        return sum(s[0].numel() * s.element_size() for s in self.states)

    def open(self) -> int:
        """A fresh stream's slot (its state reads as zeros until its first frames arrive)."""
        if not self._free:
            raise CapacityError(f"all {self.max_slots} codec stream slots are in use")
        slot = self._free.pop()
        self._streams[slot] = self._new_stream()
        return slot

    def close(self, slot: int) -> None:
        if slot not in self._streams:
            raise InvalidInputError(f"codec stream slot {slot!r} is not open")
        del self._streams[slot]
        self._free.append(slot)

    # ---- decode ----
    def step(self, slots: Sequence[int], codes: torch.Tensor | np.ndarray, valid: Sequence[int],
             final: Sequence[bool]) -> Any:
        raise NotImplementedError

    def push(self, slots: Sequence[int], codes: torch.Tensor | np.ndarray, valid: Sequence[int],
             final: Sequence[bool]) -> list[torch.Tensor]:
        """Advance each slot by its valid frames; returns per row the new exact samples (float32, device;
        views of a buffer the next call overwrites). final[b]: these are the row's last frames."""
        out = self.step(slots, codes, valid, final)
        return [out.audio[i, o:o + c] for i, (o, c) in enumerate(zip(out.offsets, out.counts))]

    @staticmethod
    def _ended(stream: Any) -> bool:
        """Whether a slot's stream had its final push (the subclass's bookkeeping says)."""
        raise NotImplementedError

    def _check(self, slots: Sequence[int], codes: torch.Tensor | np.ndarray, valid: Sequence[int],
               final: Sequence[bool]) -> tuple[torch.Tensor, list[Any]]:
        """A push's arguments, checked (InvalidInputError naming what is wrong): codes as a tensor
        [n, Q, C] of ints, each slot open, not ended and named once, valid[b] in 0..C, and every valid
        code in 0..codebook_size-1. Returns (codes, the slots' streams)."""
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
            if self._ended(s):
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
                raise InvalidInputError(f"codes must lie in 0..{self.geometry.codebook_size - 1}; "
                                        f"replace stream BOS/EOS first")
        return codes, streams

    # ---- steps: staged inputs, graph or eager ----
    def _math(self, inp: torch.Tensor, key: Key) -> torch.Tensor:
        """One batched step from the staged inputs; updates the arena in place; returns audio [B, C * hop].
        Capturable: no host sync, no data-dependent shape."""
        raise NotImplementedError

    def _check_graph(self, key: Key, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> float:
        """One replay vs the eager step from the same arena and random inputs: max |d| / peak."""
        raise NotImplementedError

    def _input_size(self, key: Key) -> int:
        return input_size(key, self.geometry.num_codebooks, self.STEP_FIELDS)

    def _stage(self, inp: torch.Tensor, key: Key, slots: Sequence[int], codes: torch.Tensor,
               *fields: Sequence[int]) -> None:
        """Write one step's inputs into `inp` (codes [B, Q, C], then slot and the decoder's fields [F, B]):
        padding rows are the scratch slot with every field 0 (nothing valid, position 0). Codes beyond a
        row's valid frames stay junk: the step masks them."""
        stage_inputs(inp, key, codes, (slots, *fields), (self.scratch,) + (0,) * (self.STEP_FIELDS - 1))

    def _stage_padding(self, inp: torch.Tensor, key: Key) -> None:
        """Inputs of a step whose rows are all padding: it touches only the scratch slot."""
        empty = torch.zeros((0, self.geometry.num_codebooks, 0), dtype=torch.long)
        self._stage(inp, key, [], empty, *([[]] * (self.STEP_FIELDS - 1)))

    def _run(self, slots: list[int], codes: torch.Tensor, width: int, *fields: list[int]) -> torch.Tensor:
        """One batched step padded to the smallest bucket that holds it (else its exact shape): a graph
        replay when one was captured. Returns audio [n, C * hop] (a view of the graph's buffer when replayed)."""
        n = len(slots)
        key = self._bucket(n, width) or (n, width)
        graph = self._graphs.get(key)
        with torch.no_grad(), self.codec.precision():
            if graph is None:
                inp = torch.empty(self._input_size(key), dtype=torch.long, device=self.device)
                self._stage(inp, key, slots, codes, *fields)
                return self._math(inp, key)[:n]
            self._stage(self._inputs[key], key, slots, codes, *fields)
            graph.replay()
            self.replays += 1
            return self._outputs[key][:n]

    def _eager(self, key: Key) -> torch.Tensor:
        """The eager step from the bucket's staged inputs, as `_check_graph` compares a replay with: the decoder's own
        kernels, or with `check_against_native` PyTorch's native convolutions (cuDNN off)."""
        if not self._native_reference:
            return self._math(self._inputs[key], key)
        with codec_convs(self.device, allow_tf32=False, cudnn=False):  # the codecs' own switch, forced off
            return self._math(self._inputs[key], key)

    def check_against_native(self, max_row_frames: int = NATIVE_CHECK_ROW_FRAMES) -> float:
        """Each captured bucket of at most `max_row_frames` rows x frames replayed vs the same step with cuDNN off
        (PyTorch's native convolutions: an implementation that shares no kernel with cuDNN's), on `_check_graph`'s
        random inputs; returns the largest max |d| / peak (0.0 without graphs; the arena is restored). A cuDNN plan
        that returns wrong sums shows here far above fp32 rounding (engine/gpu_memory.py: 0.21 of peak on an H200);
        larger buckets are left out (the native convolutions are slow and take much memory there)."""
        keys = [k for k in self._graphs if k[0] * k[1] <= max_row_frames]
        self._native_reference = True
        try:
            with torch.no_grad(), self.codec.precision():
                return max(checked_replays(keys, self._graphs, self._outputs, self._check_graph, self.states),
                           default=0.0)
        finally:
            self._native_reference = False

    def run_padding_steps(self, batch_buckets: Sequence[int], frame_buckets: Sequence[int]) -> int:
        """One eager step of padding rows (they touch only the scratch slot) at every (B, C) bucket shape, largest
        first: each convolution's first call at that shape picks and caches its cuDNN plan here, so a caller can
        choose the memory those plans may take (engine/gpu_memory.py) before `capture` records them. Returns the
        number of shapes run."""
        keys = sorted(bucket_keys(batch_buckets, frame_buckets, self.max_slots), reverse=True)
        with torch.no_grad(), self.codec.precision():
            for key in keys:
                inp = torch.zeros(self._input_size(key), dtype=torch.long, device=self.device)
                self._stage_padding(inp, key)
                self._math(inp, key)
                del inp
        return len(keys)

    def capture(self, batch_buckets: Sequence[int], frame_buckets: Sequence[int], graphs: bool = True,
                stream: torch.cuda.Stream | None = None) -> float:
        """Pad every step to the smallest (B, C) bucket that holds it and, with `graphs`, replay it from a
        CUDA graph captured per bucket. Each graph is checked against the eager step on random inputs
        (`_check_graph`); returns the largest max |d| / peak (0.0 without graphs). Above CAPTURE_TOLERANCE
        all graphs and buckets are dropped (logged as an error) and steps run eagerly at their exact
        shapes. Every bucket's replay is timed (`timings`, `step_cost`). `graphs=False` keeps the padding
        but runs eagerly (debugging; the only mode on CPU). The arena's contents are preserved. `stream`:
        capture on it (a green context's, see engine/green_context.py), else on side streams."""
        if graphs and self.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA codec, it is on {self.device}")
        keys = bucket_keys(batch_buckets, frame_buckets, self.max_slots)
        self._buckets, self._graphs, self._outputs, self._inputs, self.timings = keys, {}, {}, {}, {}
        self.capture_check = 0.0
        if not graphs or not keys:
            return self.capture_check

        def stage(key: Key) -> None:  # warm-up and capture from padding rows only
            self._inputs[key] = torch.zeros(self._input_size(key), dtype=torch.long, device=self.device)
            self._stage_padding(self._inputs[key], key)

        with torch.no_grad(), self.codec.precision():
            captured, outputs, self.capture_check = capture_checked(
                keys, stage, lambda key: self._math(self._inputs[key], key), self._check_graph, self.states,
                self.device, stream, self.GRAPH_NAME)
        if not captured:  # the check failed (logged): decode eagerly at exact shapes
            self._buckets, self._inputs = [], {}
            return self.capture_check
        self._graphs, self._outputs = captured, outputs
        self.timings = {key: self._time_replay(key) for key in keys}
        return self.capture_check

    def _time_replay(self, key: Key) -> float:
        """Median seconds of a bucket's graph replay (padding rows only: the arena's streams are untouched)."""
        self._stage_padding(self._inputs[key], key)
        return replay_seconds(self._graphs[key])

    # ---- buckets, graphs, cost ----
    def _bucket(self, n: int, width: int) -> Key | None:
        """The smallest (B, C) bucket that holds n rows of `width` frames, if any."""
        return smallest_bucket(self._buckets, n, width)

    def step_cost(self, n: int, width: int) -> float:
        """Predicted seconds of one step of n rows, the widest `width` frames: the bucket's timed replay
        when graphed, else the STEP_* model."""
        key = self._bucket(n, width)
        if key in self.timings:
            return self.timings[key]
        b, c = key or (n, width)
        return STEP_FIXED_S + b * (STEP_ROW_S + c * STEP_ROW_FRAME_S)

    @property
    def largest_step(self) -> Key | None:
        """(streams, frames) a step may have and still fit a bucket (None: steps run at their own shapes).
        A caller with more splits its push (stream/adapter.py): a stream's frames may arrive in any pieces."""
        if not self._buckets:
            return None
        return max(b for b, _ in self._buckets), max(c for _, c in self._buckets)

    @property
    def graphed(self) -> bool:
        """Whether steps replay CUDA graphs (after a successful `capture`)."""
        return bool(self._graphs)
