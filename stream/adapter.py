"""Code2Wav streaming adapter: codec frames in, PCM chunks out, exact by default.

Per segment, `Code2WavAdapter` collects the codec frames the engine emits (`StepEvent.frame`, real
codes laid out as the codec declares: the model family's writer has turned its rows into frames)
and plans its chunks over the codec's declared geometry (`stream/chunking.py`): exact chunks are `PushJob`s, frames pushed once
into the codec's stateful `StreamingDecoder` (every frame through every layer once; output equal
to the one-shot decode to fp32 rounding); low-latency ramp chunks are `WindowJob`s, windows
decoded one-shot with a short holdback (approximate, sooner). `Code2Wav` runs the jobs of many
segments: all windows of a call in few batched decodes, all pushes in one batched stateful step.

Two ways to drive it:
- `push(frame)` / `finish()` on an adapter built over a Codec decode at once (tests, offline use);
- `feed(frame)` / `close()` / `take_jobs()`, then `Code2Wav.run(owners, jobs)` serve every stream
  that is due in one step with one stateful call (the pipeline's codec worker).
- `feed_frames(adapters, frames, finals)` feeds one step's frames of many streams with one
  validation for all of them (the pipeline's hot path); `jobs_to_s16le` turns a call's chunks into
  s16le bytes with one conversion.

Per frame the adapter keeps plain Python ints: a serving step touches every stream, and small
numpy calls cost more than the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from higgs_stream.engine.codec.arena import STEP_EAGER_S
from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.errors import ConfigError, InvalidInputError
from higgs_stream.stream.chunking import AdapterConfig, ChunkPlanner, Push, Window

S16_SCALE = 32767.0

DecodeFn = Callable[[torch.Tensor], torch.Tensor]  # codes [B, Q, F] long -> [B, F * hop] float32


@dataclass(frozen=True)
class WindowJob:
    """A low-latency ramp chunk: decode `codes` one-shot, keep frames [left, left + new)."""

    codes: np.ndarray  # [Q, W] int64, real codes
    left: int
    new: int

    @property
    def frames(self) -> int:
        return self.codes.shape[1]


@dataclass(frozen=True)
class PushJob:
    """Frames for the stream's stateful decoder (see `chunking.Push` for the sample bookkeeping)."""

    codes: np.ndarray  # [Q, n] int64, real codes
    push: Push


Job = WindowJob | PushJob


def to_host(t: torch.Tensor) -> np.ndarray:
    """`t` as float32 numpy. From a GPU: one asynchronous copy into pinned memory and a wait on its event
    (a plain `.cpu()` copies into pageable memory: the driver stages it synchronously, and the talker's
    thread shares that driver)."""
    t = t.detach()
    if t.device.type != "cuda":
        return t.to(torch.float32).numpy()
    host = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.numpy()


def decode_windows(decode: DecodeFn, hop: int, jobs: Sequence[WindowJob],
                   batch_buckets: Sequence[int] | None = None) -> list[np.ndarray]:
    """One-shot decode of ramp windows, one codec call per distinct window length (windows are
    never padded: zero padding changes a non-causal codec's edge samples). With `batch_buckets`
    (a GPU codec, whose first call at a new shape is slow) each call's batch is padded with code-0
    rows up to the smallest bucket that holds it; padding rows are decoded and dropped."""
    groups: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(job.frames, []).append(i)
    chunks: list[np.ndarray | None] = [None] * len(jobs)
    largest = max(batch_buckets) if batch_buckets else None
    for length, members in groups.items():
        parts = [members] if largest is None else [members[a : a + largest] for a in range(0, len(members), largest)]
        for part in parts:
            rows = len(part) if largest is None else min(b for b in batch_buckets if b >= len(part))
            q = jobs[part[0]].codes.shape[0]
            batch = np.zeros((rows, q, length), dtype=np.int64)  # [B, Q, W], pad rows = code 0
            for row, i in enumerate(part):
                batch[row] = jobs[i].codes
            out = decode(torch.from_numpy(batch))  # [B, W * hop]
            assert tuple(out.shape) == (rows, length * hop), f"decoder returned {tuple(out.shape)} for {batch.shape}"
            pcm = to_host(out[: len(part)])
            for row, i in enumerate(part):
                job = jobs[i]
                chunks[i] = pcm[row, job.left * hop : (job.left + job.new) * hop].copy()
    return chunks


class Code2Wav:
    """Runs the decode jobs of many segments on one codec: windows one-shot, pushes through one
    `StreamingDecoder` (a slot per segment, opened at its first push, closed after its final push
    or by `release`). `owners` are hashable segment keys; results keep the jobs' order."""

    def __init__(self, codec: Any, max_slots: int, window_decode: DecodeFn | None = None,
                 window_buckets: Sequence[int] | None = None) -> None:
        self.codec = codec
        self.geometry: CodecGeometry = codec.geometry
        self.streaming = codec.streaming_decoder(max_slots)  # open / close / step, as StreamingDecoder
        self.window_decode = window_decode or codec.decode
        self.window_buckets = window_buckets
        self._slots: dict[Hashable, int] = {}
        self.steps = 0  # stateful decoder steps run (a call's pushes may take several: `partition`)
        self.partition_steps = True  # False: every call's pushes in one step (benchmarks' A/B)
        # seconds an eager step at an unbucketed shape costs beyond the decoder's step model (`_pieces`): on a GPU,
        # where the buckets replay from CUDA graphs, STEP_EAGER_S; on a CPU every step is eager (0)
        device = getattr(codec, "device", None)
        self.eager_step_s = STEP_EAGER_S if device is not None and torch.device(device).type == "cuda" else 0.0

    @property
    def open_streams(self) -> int:
        return len(self._slots)

    def release(self, owner: Hashable) -> None:
        """Free `owner`'s decoder state (its segment ended without a final push, or failed)."""
        slot = self._slots.pop(owner, None)
        if slot is not None:
            self.streaming.close(slot)

    def run(self, owners: Sequence[Hashable], jobs: Sequence[Job]) -> list[np.ndarray]:
        """Each job's float32 chunk (possibly empty for a push whose samples the ramp already sent)."""
        out: list[np.ndarray | None] = [None] * len(jobs)
        windows = [i for i, j in enumerate(jobs) if isinstance(j, WindowJob)]
        if windows:
            pcm = decode_windows(self.window_decode, self.geometry.hop, [jobs[i] for i in windows], self.window_buckets)
            for i, chunk in zip(windows, pcm):
                out[i] = chunk
        rows: dict[Hashable, list[int]] = {}  # owner -> its push jobs, in order (consecutive pushes)
        for i, (owner, job) in enumerate(zip(owners, jobs)):
            if isinstance(job, PushJob):
                rows.setdefault(owner, []).append(i)
        if rows:
            self._push(rows, jobs, out)
        return out  # type: ignore[return-value]

    def _push(self, rows: dict[Hashable, list[int]], jobs: Sequence[Job], out: list) -> None:
        """All due streams' frames through the stateful decoder: in one step, or in the few steps by width
        that cost less (`StreamingDecoder.partition`: a step pads every row to its widest)."""
        owners, slots, codes, valid, final = [], [], [], [], []
        for owner, members in rows.items():
            if owner not in self._slots:
                self._slots[owner] = self.streaming.open()
            owners.append(owner)
            slots.append(self._slots[owner])
            parts = [jobs[i].codes for i in members]
            codes.append(np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])
            valid.append(codes[-1].shape[1])
            final.append(jobs[members[-1]].push.final)
        groups = self.streaming.partition(slots, valid, final) if self.partition_steps else [list(range(len(slots)))]
        got: list[list[np.ndarray]] = [[] for _ in slots]  # each row's samples, piece by piece
        for group in groups:
            for piece in self._pieces(group, valid, final):  # within the largest bucket (graph replays)
                width = max(v for _, v, _ in piece)
                batch = np.zeros((len(piece), self.geometry.num_codebooks, width), dtype=np.int64)  # [B, Q, C]
                for b, (r, v, off) in enumerate(piece):
                    batch[b, :, :v] = codes[r][:, off:off + v]
                step = self.streaming.step([slots[r] for r, _, _ in piece], torch.from_numpy(batch),
                                           [v for _, v, _ in piece],
                                           [final[r] and off + v == valid[r] for r, v, off in piece])
                self.steps += 1
                audio = to_host(step.audio)  # one copy for the step's rows
                for b, (r, _, _) in enumerate(piece):
                    got[r].append(audio[b, step.offsets[b] : step.offsets[b] + step.counts[b]])
        for r, owner in enumerate(owners):
            members = rows[owner]
            first = jobs[members[0]].push.out_from
            pcm = np.concatenate(got[r]) if len(got[r]) > 1 else got[r][0]
            want = jobs[members[-1]].push.out_to - first
            assert pcm.size == want, f"stateful decoder returned {pcm.size} samples, the plan says {want}"
            for i in members:
                p = jobs[i].push
                out[i] = pcm[p.emit_start - first : p.out_to - first].copy()
            if final[r]:
                self.release(owner)

    def _pieces(self, group: list[int], valid: list[int], final: list[bool]) -> list[list[tuple[int, int, int]]]:
        """A step group as steps of (row, frames, offset). One step when it fits the decoder's largest bucket:
        no row runs more frames than its widest bucket (a final row runs its flush too) and the rows x frames are no
        more than the largest bucket's (an eager step then needs no more memory than the largest graph: e.g. 128
        streams of one frame each), or when the decoder has no buckets. Else each row's frames in order in pieces of
        at most the widest bucket's frames, a final row's last piece short enough to run its flush within it
        (`_row_pieces`), piece k of every row in steps of at most the largest bucket's streams: a backlog of many
        frames from many streams once ran as one eager step of any size and ran a served Qwen3-TTS 1.7B out of GPU
        memory. Within the memory bound, a group whose rows are too wide for a bucket runs as one eager step at its
        own width where the decoder's step model (`step_cost`) plus `eager_step_s` says that is cheaper than the
        pieces (many rows: the pieces pad to batch buckets) and as the pieces where not (a few rows: a stream's
        held pushes joined to its final one, 33-59 frames + the flush, ran as eager steps of 14-86 ms on an H200,
        session 30)."""
        largest = getattr(self.streaming, "largest_step", None)  # optional in a decoder's interface
        one = [[(r, valid[r], 0) for r in group]]
        if largest is None:
            return one
        max_b, max_c = largest
        pad = self.geometry.lookahead_frames
        reach = max_c - pad if max_c > pad else max_c  # a final row's frames that run with their flush in a bucket
        width = max([valid[r] for r in group] + [1])
        in_memory = len(group) * width <= max_b * max_c
        if in_memory and all(valid[r] <= (reach if final[r] else max_c) for r in group):
            return one
        pieces = {r: _row_pieces(valid[r], reach if final[r] else max_c, max_c) for r in group}
        steps = []
        for k in range(max(len(p) for p in pieces.values())):  # frame pieces, in order
            rows = [(r, *pieces[r][k]) for r in group if k < len(pieces[r])]
            steps += [rows[i:i + max_b] for i in range(0, len(rows), max_b)]
        cost = getattr(self.streaming, "step_cost", None)
        if in_memory and cost is not None:
            def runs(step):  # the frames each step runs: the widest piece, a final piece with its flush
                return max(v + (pad if final[r] and off + v == valid[r] else 0) for r, v, off in step)

            if cost(len(group), runs(one[0])) + self.eager_step_s <= sum(cost(len(s), runs(s)) for s in steps):
                return one
        return steps


def _row_pieces(frames: int, last: int, most: int) -> list[tuple[int, int]]:
    """(frames, offset) pieces of a row's frames in order: none above `most`, the last at most `last` (<= most) and
    never empty unless the row is (a final push of no frames is one piece), as few as that allows."""
    pieces, off = [], 0
    while frames - off > last:
        n = min(most, frames - off - last)
        pieces.append((n, off))
        off += n
    return pieces + [(frames - off, off)]


def feed_frames(adapters: Sequence[Code2WavAdapter], frames: np.ndarray,
                finals: Sequence[bool]) -> list[InvalidInputError | None]:
    """Feed frame i ([B, Q] ints) to adapters[i] (final=finals[i]) with one range check for the
    whole step. Raises InvalidInputError before any adapter changed when the step's array is bad
    (then `feed()` each frame to find the bad stream); returns, per adapter, the error that
    adapter alone refused its frame with (a frame after the end), or None."""
    arr = np.asarray(frames)
    q = adapters[0].geometry.num_codebooks if adapters else 0
    size = adapters[0].geometry.codebook_size if adapters else 0
    if arr.ndim != 2 or arr.shape != (len(adapters), q) or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidInputError(f"a step's frames are [{len(adapters)}, {q}] integer codes, got {arr.dtype} {arr.shape}")
    rows = arr.tolist()  # plain ints from here: small numpy calls would release and re-take the GIL
    if rows and (min(map(min, rows)) < 0 or max(map(max, rows)) >= size):
        raise InvalidInputError(f"frame codes must be in 0..{size - 1}")
    errors: list[InvalidInputError | None] = []
    for adapter, values, final in zip(adapters, rows, finals):
        try:
            adapter._feed_values(values, final)
            errors.append(None)
        except InvalidInputError as exc:
            errors.append(exc)
    return errors


def jobs_to_s16le(chunks: Sequence[np.ndarray]) -> list[bytes | None]:
    """`to_s16le` of many float chunks with one conversion: the same bytes per chunk, or None for a
    chunk holding NaN or infinity (its stream has failed; the others are unaffected)."""
    if not chunks:
        return []
    for c in chunks:
        if c.ndim != 1:
            raise InvalidInputError(f"pcm must be one channel [S], got shape {c.shape}")
    sizes = [c.size for c in chunks]
    x = np.concatenate(chunks).astype(np.float64)
    finite = np.isfinite(x)
    bad: set[int] = set()
    if not finite.all():
        ends = np.cumsum(sizes)
        bad = set(np.searchsorted(ends, np.flatnonzero(~finite), side="right").tolist())
        x[~finite] = 0.0
    data = np.rint(np.clip(x, -1.0, 1.0) * S16_SCALE).astype("<i2").tobytes()
    out: list[bytes | None] = []
    at = 0
    for i, n in enumerate(sizes):
        out.append(None if i in bad else data[2 * at : 2 * (at + n)])
        at += n
    return out


class Code2WavAdapter:
    """Turns one audio segment's codec frames into decode jobs (and, over a Codec, PCM).

    `Code2WavAdapter(codec_or_geometry, config)` or `Code2WavAdapter(codec, mode=..., schedule=...,
    ramp_holdbacks=...)`. Over a `CodecGeometry` it only plans (`take_jobs`); over a Codec it can
    also decode at once (`push`/`finish`, with a private one-slot `Code2Wav`).

    A segment ends one of two ways, both flushing its tail to the true end:
    - `push(frame, final=True)`: the last frame, the stream finished (StepEvent.finished with
      reason "stop" or "length" and a frame);
    - `finish()` (or `close()` when planning): no more frames (the stream finished without a frame
      on its last event, or was cut short). After a final frame, `finish()` returns [].
    """

    def __init__(self, decoder: Any, config: AdapterConfig | None = None, **fields: Any) -> None:
        if config is not None and fields:
            raise ConfigError(f"pass either an AdapterConfig or fields, not both ({sorted(fields)})")
        self.config = config if config is not None else AdapterConfig(**fields)
        if isinstance(decoder, CodecGeometry):
            self.geometry, self._codec = decoder, None
        elif hasattr(decoder, "geometry"):
            self.geometry, self._codec = decoder.geometry, decoder
        else:
            raise ConfigError(f"decoder must be a Codec or a CodecGeometry, got {type(decoder).__name__}")
        self.planner = ChunkPlanner(self.config, self.geometry)
        self._frames: list[list[int]] = []  # known frames [frame_base, available), each Q ints
        self._frame_base = 0
        self._runner: Code2Wav | None = None

    # ---- bookkeeping (no codec calls) ----

    @property
    def samples_emitted(self) -> int:
        return self.planner.emitted

    @property
    def num_frames(self) -> int:
        """Frames fed so far."""
        return self.planner.available

    @property
    def done(self) -> bool:
        """Ended and every audio sample planned."""
        return self.planner.done

    def feed(self, frame: np.ndarray, final: bool = False) -> None:
        """Append one codec frame (int [Q], codes 0..codebook_size-1); final=True: the segment's last."""
        arr = np.asarray(frame)
        q, size = self.geometry.num_codebooks, self.geometry.codebook_size
        if arr.shape != (q,) or not np.issubdtype(arr.dtype, np.integer):
            raise InvalidInputError(f"a frame is {q} integer codes, got {arr.dtype} {arr.shape}")
        if arr.min() < 0 or arr.max() >= size:
            raise InvalidInputError(f"frame codes must be in 0..{size - 1}, got {arr.tolist()}")
        self._feed_values(arr.tolist(), final)

    def _feed_values(self, values: list[int], final: bool) -> None:
        """`feed` of a frame already checked to be Q ints in 0..codebook_size-1."""
        if self.planner.finished:
            raise InvalidInputError("frame pushed after the segment ended")
        self._frames.append(values)
        self.planner.available += 1
        if final:
            self.planner.finished = True

    def close(self) -> None:
        """End the segment without a final frame; the next job runs to the true end."""
        self.planner.finished = True

    def take_jobs(self) -> list[Job]:
        """The jobs that are due (planned as taken): none, a push, or a ramp window and its push."""
        jobs: list[Job] = []
        for plan in self.planner.take():
            if isinstance(plan, Window):
                jobs.append(WindowJob(self._codes(plan.start, plan.stop), plan.left, plan.new))
            else:
                jobs.append(PushJob(self._codes(plan.start, plan.stop), plan))
        if jobs:
            self._trim()
        return jobs

    def _codes(self, start: int, stop: int) -> np.ndarray:
        lo, hi = start - self._frame_base, stop - self._frame_base
        assert 0 <= lo <= hi <= len(self._frames), (
            f"frames [{start}, {stop}) outside the kept frames [{self._frame_base}, {self._frame_base + len(self._frames)})")
        if lo == hi:
            return np.zeros((self.geometry.num_codebooks, 0), dtype=np.int64)
        return np.array(self._frames[lo:hi], dtype=np.int64).T  # [Q, n]

    # ---- one stream on its own ----

    def push(self, frame: np.ndarray, final: bool = False) -> list[np.ndarray]:
        """Append a frame; returns the float32 PCM chunks that became due (none or more)."""
        self.feed(frame, final)
        return self._decode_due()

    def finish(self) -> list[np.ndarray]:
        """End the segment (if no final frame came) and flush the tail, decoded to the true end."""
        self.close()
        return self._decode_due()

    def _decode_due(self) -> list[np.ndarray]:
        jobs = self.take_jobs()
        if not jobs:
            return []
        if self._codec is None:
            raise ConfigError("this adapter was built over a geometry: run its jobs with Code2Wav")
        if self._runner is None:
            self._runner = Code2Wav(self._codec, max_slots=1)
        return [c for c in self._runner.run([self] * len(jobs), jobs) if c.size]

    def _trim(self) -> None:
        """Drop frames no future job needs (before the next window's left context and the pushed ones)."""
        hop, rf = self.geometry.hop, self.geometry.receptive_field
        keep_from = min(self.planner.pushed, max(0, self.planner.emitted // hop - rf))
        drop = keep_from - self._frame_base
        if drop >= 64:
            del self._frames[:drop]
            self._frame_base = keep_from


def to_s16le(pcm: np.ndarray) -> bytes:
    """float PCM -> 16-bit little-endian bytes: clip to [-1, 1], scale by 32767, round half to even.

    The product is formed in float64 (exact for float32 input), so the result does not depend on
    the input dtype's rounding; -1.0 maps to -32767 (the scale is symmetric). The offline synth
    path must write its WAV/PCM through this same function.
    """
    x = np.asarray(pcm)
    if x.ndim != 1:
        raise InvalidInputError(f"pcm must be one channel [S], got shape {x.shape}")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise InvalidInputError("pcm contains NaN or infinity")
    return np.rint(np.clip(x, -1.0, 1.0) * S16_SCALE).astype("<i2").tobytes()


def write_wav(path: str, pcm: np.ndarray, sample_rate: int) -> None:
    """Write float PCM as a 16-bit mono WAV through `to_s16le` (the bytes the server streams)."""
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(to_s16le(pcm))
