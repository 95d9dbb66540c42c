"""Sliding-window Code2Wav streaming adapter: delay-pattern columns in, PCM chunks out.

The Higgs v2 codec decoder is non-causal with a receptive field of ±10 frames, so a window
[left context | new frames | right holdback] with 10 frames on both sides reproduces the one-shot
decode of the whole utterance for the new frames (exact mode). The chunk schedule and the window
arithmetic live in `stream/chunking.py`; this module owns the column buffer, the codec calls and
the PCM conversion.

Two ways to drive it:
- `push(column)` / `finish()` decode at once, one codec call per due window;
- `feed(column)` / `close()` / `take_job()` + `decode_jobs(decoder, jobs)` let the pipeline serve
  every stream that is due in one step with as few codec calls as possible (one when the
  windows allow it). At most one job per stream is due after each column.
- `feed_columns(adapters, columns, finals)` feeds one step's columns of many streams with one
  validation for all of them (the pipeline's hot path); `jobs_to_s16le` turns a decode call's
  chunks into s16le bytes with one conversion.

Per column the adapter works on plain Python ints (the delay revert and the stray fill of
`engine.delay.ColumnReverter`, re-stated without numpy): a serving step touches every stream, and
small numpy calls cost more than the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from higgs_stream.engine.delay import STRAY_FALLBACK_CODE, STREAM_BOS, STREAM_EOS
from higgs_stream.engine.errors import ConfigError, InvalidInputError
from higgs_stream.stream.chunking import NUM_CODEBOOKS, AdapterConfig, ChunkPlanner, Window

HOP = 960  # samples per codec frame at 24 kHz
S16_SCALE = 32767.0

DecodeFn = Callable[[torch.Tensor], torch.Tensor]  # codes [B, 8, F] long -> [B, F * hop] float32


@dataclass(frozen=True)
class Decoder:
    """A codec decode function with the geometry the adapter needs."""

    fn: DecodeFn
    hop: int = HOP
    receptive_field: int = 10

    @staticmethod
    def of(decoder: Any) -> Decoder:
        """Wrap a `Codec` (has .decode/.hop/.receptive_field), a `Decoder`, or a bare decode fn."""
        if isinstance(decoder, Decoder):
            return decoder
        if hasattr(decoder, "decode"):
            return Decoder(decoder.decode, int(decoder.hop), int(decoder.receptive_field))
        if callable(decoder):
            return Decoder(decoder)
        raise ConfigError(f"decoder must be a Codec or a decode callable, got {type(decoder).__name__}")

    def __call__(self, codes: np.ndarray, rows: int | None = None) -> np.ndarray:
        """codes [B, 8, F] int64 -> pcm [rows, F * hop] float32 (numpy, CPU); rows: the first
        `rows` results only (padding rows stay on the device)."""
        batch, _, frames = codes.shape
        out = self.fn(torch.from_numpy(np.ascontiguousarray(codes)))  # [B, F * hop]
        shape = tuple(out.shape)
        out = out.reshape(batch, -1)
        assert tuple(out.shape) == (batch, frames * self.hop), (
            f"decoder returned {shape} for codes {codes.shape}, expected {(batch, frames * self.hop)}"
        )
        if rows is not None:
            out = out[:rows]
        return out.detach().to("cpu", torch.float32).numpy()


@dataclass(frozen=True)
class DecodeJob:
    """One stream's decode window: decode `codes`, keep frames [left, left + new)."""

    codes: np.ndarray  # [8, W] int64, real codes 0..1023
    left: int  # frames of left context to drop
    new: int  # frames to emit
    pad_ok: bool  # extra frames appended on the right leave the kept samples unchanged
    window: Window

    @property
    def frames(self) -> int:
        return self.codes.shape[1]


def decode_jobs(decoder: Any, jobs: Sequence[DecodeJob], batch_buckets: Sequence[int] | None = None,
                length_quantum: int = 1) -> list[np.ndarray]:
    """Decode many streams' windows in as few codec calls as possible; returns each job's chunk.

    Jobs are batched by window length. Zero-padding a window changes the non-causal edge samples,
    so only a job with `pad_ok` (right context >= the receptive field, not the utterance end) may
    be right-padded: it joins the shortest batch at least as long as itself, or else all padded
    jobs share one batch at the longest of them. Others batch only with equal lengths. With the
    exact default every window is <= 45 frames and only final windows are unpaddable, so a step
    costs one call plus one per distinct final-window length. Results equal per-job decodes up to
    fp32 rounding (conv kernels round differently for other batch shapes).

    Shape buckets (for a GPU codec, whose first call at each new shape is slow): the padded batch's
    length is rounded up to a multiple of `length_quantum`, and with `batch_buckets` every call's
    batch is padded with code-0 rows up to the smallest bucket that holds it (a larger group is
    split into calls of the largest bucket). Padding rows are decoded and dropped.
    """
    dec = Decoder.of(decoder)
    assert length_quantum >= 1, f"length_quantum must be >= 1, got {length_quantum}"
    groups: dict[int, list[int]] = {}  # window length -> job indices
    for i, job in enumerate(jobs):
        if not job.pad_ok:
            groups.setdefault(job.frames, []).append(i)
    padded = [i for i, job in enumerate(jobs) if job.pad_ok]
    if padded:
        longest = max(jobs[j].frames for j in padded)
        longest = -(-longest // length_quantum) * length_quantum
    for i in sorted(padded, key=lambda i: jobs[i].frames):
        fits = [length for length in groups if length >= jobs[i].frames]
        if fits:
            groups[min(fits)].append(i)
        else:  # longer than every batch so far: open one at the (rounded) longest, shorter pads follow
            groups.setdefault(longest, []).append(i)
    chunks: list[np.ndarray | None] = [None] * len(jobs)
    largest = max(batch_buckets) if batch_buckets else None
    for length, members in groups.items():
        parts = [members] if largest is None else [members[a : a + largest] for a in range(0, len(members), largest)]
        for part in parts:
            rows = len(part) if largest is None else min(b for b in batch_buckets if b >= len(part))
            batch = np.zeros((rows, NUM_CODEBOOKS, length), dtype=np.int64)  # [B, 8, W], pad = code 0
            for row, i in enumerate(part):
                batch[row, :, : jobs[i].frames] = jobs[i].codes
            pcm = dec(batch, rows=len(part))  # [len(part), W * hop]
            for row, i in enumerate(part):
                job = jobs[i]
                chunks[i] = pcm[row, job.left * dec.hop : (job.left + job.new) * dec.hop].copy()
    return chunks


def feed_columns(adapters: Sequence[Code2WavAdapter], columns: np.ndarray,
                 finals: Sequence[bool]) -> list[InvalidInputError | None]:
    """Feed column i ([B, 8] ints) to adapters[i] (final=finals[i]) with one range check for the
    whole step. Raises InvalidInputError before any adapter changed when the step's array is bad
    (then `feed()` each column to find the bad stream); returns, per adapter, the error that
    adapter alone refused its column with (a first column that is not all BOS, a column after
    the end), or None."""
    col = np.asarray(columns)
    if col.ndim != 2 or col.shape != (len(adapters), NUM_CODEBOOKS) or not np.issubdtype(col.dtype, np.integer):
        raise InvalidInputError(f"a step's columns are [{len(adapters)}, {NUM_CODEBOOKS}] integer codes, "
                                f"got {col.dtype} {col.shape}")
    rows = col.tolist()  # plain ints from here: small numpy calls would release and re-take the GIL
    if rows and (min(map(min, rows)) < 0 or max(map(max, rows)) > STREAM_EOS):
        raise InvalidInputError(f"column codes must be in 0..{STREAM_EOS}")
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


class _FrameReverter:
    """`engine.delay.ColumnReverter` on Python ints: columns [K] in, complete frames [K] out.

    Frame f takes codebook j from column f + j and is complete once column f + K - 1 arrives;
    frame 0 (stream BOS) and the frame completed by a final column (EOS) are dropped. Stray ids
    (outside 0..codebook_size-1) take the codebook's last valid code (`StrayFill`'s causal rule).
    """

    def __init__(self, num_codebooks: int, codebook_size: int = STREAM_BOS) -> None:
        self.k, self.codebook_size = num_codebooks, codebook_size
        self._ring: list[list[int]] = [[0] * num_codebooks for _ in range(num_codebooks)]  # column c at c % K
        self._count = 0
        self._last_valid = [STRAY_FALLBACK_CODE] * num_codebooks
        self.num_replaced = 0

    def push(self, column: list[int], final: bool = False) -> list[int] | None:
        k = self.k
        self._ring[self._count % k] = column
        self._count += 1
        f = self._count - k  # frame completed by this column (if >= 0)
        if f < 1 or final:  # not complete yet, the BOS frame, or the EOS frame
            return None
        ring, size, last = self._ring, self.codebook_size, self._last_valid
        frame = [ring[(f + j) % k][j] for j in range(k)]
        for j, v in enumerate(frame):
            if v < 0 or v >= size:
                frame[j] = last[j]
                self.num_replaced += 1
        self._last_valid = frame
        return frame


class Code2WavAdapter:
    """Turns one audio segment's delay-pattern columns into float32 PCM chunks.

    `Code2WavAdapter(codec_or_decode_fn, config)` or `Code2WavAdapter(codec, mode=..., schedule=...,
    left_context=..., holdback=..., ramp_holdbacks=...)`.

    Columns are reverted incrementally (`_FrameReverter`: the same stray-BOS/EOS rule as the
    offline `columns_to_frames`). Two ways to end a segment:
    - `push(column, final=True)` with the last column of the EOS ramp-out (StepEvent.finished):
      its EOS frame is dropped and the tail is flushed — the frames of `columns_to_frames(cols)`;
    - `finish()` when the segment stops without one (cut short): every complete frame is kept —
      `columns_to_frames(cols, ended=False)`. After a final column, `finish()` returns [].
    """

    def __init__(self, decoder: Any, config: AdapterConfig | None = None, **fields: Any) -> None:
        self.decoder = Decoder.of(decoder)
        if config is not None and fields:
            raise ConfigError(f"pass either an AdapterConfig or fields, not both ({sorted(fields)})")
        if config is None:
            fields.setdefault("receptive_field", self.decoder.receptive_field)
            config = AdapterConfig(**fields)
        if config.receptive_field != self.decoder.receptive_field:
            raise ConfigError(
                f"config receptive_field {config.receptive_field} != codec's {self.decoder.receptive_field}"
            )
        self.config = config
        self.planner = ChunkPlanner(config)
        self.num_columns = 0
        self._reverter = _FrameReverter(NUM_CODEBOOKS)
        self._frames: list[list[int]] = []  # known frames [frame_base, available), each 8 ints
        self._frame_base = 0

    # ---- bookkeeping (no codec calls) ----

    @property
    def frames_emitted(self) -> int:
        return self.planner.emitted

    @property
    def done(self) -> bool:
        """Ended and every audio frame emitted."""
        return self.planner.finished and self.planner.next_window() is None

    def feed(self, column: np.ndarray, final: bool = False) -> None:
        """Append one delay-pattern column (int [8]); final=True marks the segment's last column."""
        col = np.asarray(column)
        if col.shape != (NUM_CODEBOOKS,) or not np.issubdtype(col.dtype, np.integer):
            raise InvalidInputError(f"a column is {NUM_CODEBOOKS} integer codes, got {col.dtype} {col.shape}")
        if col.min() < 0 or col.max() > STREAM_EOS:
            raise InvalidInputError(f"column codes must be in 0..{STREAM_EOS}, got {col.tolist()}")
        self._feed_values(col.tolist(), final)

    def _feed_values(self, values: list[int], final: bool) -> None:
        """`feed` of a column already checked to be 8 ints in 0..EOS."""
        if self.planner.finished:
            raise InvalidInputError("column pushed after the segment ended")
        if self.num_columns == 0 and values.count(STREAM_BOS) != NUM_CODEBOOKS:
            raise InvalidInputError(f"column 0 must be all BOS ({STREAM_BOS}), got {values}")
        frame = self._reverter.push(values, final=final)
        self.num_columns += 1
        if frame is not None:
            self._frames.append(frame)
            self.planner.available += 1
        if final:
            self.planner.finished = True

    def close(self) -> None:
        """End the segment without a final column; the next job runs to the true end."""
        self.planner.finished = True

    def take_job(self) -> DecodeJob | None:
        """The due decode window (marked emitted), or None. Decode it with `decode_jobs`."""
        if not self.planner.due():
            return None
        window = self.planner.next_window()
        if window is None:
            return None
        lo, hi = window.start - self._frame_base, window.stop - self._frame_base
        assert 0 <= lo and hi <= len(self._frames), (
            f"window [{window.start}, {window.stop}) outside the kept frames "
            f"[{self._frame_base}, {self._frame_base + len(self._frames)})"
        )
        codes = np.array(self._frames[lo:hi], dtype=np.int64).T  # [8, W]
        self.planner.advance(window)
        self._trim()
        pad_ok = not window.final and window.right >= self.decoder.receptive_field
        return DecodeJob(codes, window.left, window.new, pad_ok, window)

    # ---- one stream on its own ----

    def push(self, column: np.ndarray, final: bool = False) -> list[np.ndarray]:
        """Append a column; returns the float32 PCM chunks that became due (none or one)."""
        self.feed(column, final)
        return self._decode_due()

    def finish(self) -> list[np.ndarray]:
        """End the segment (if no final column came) and flush the tail, decoded to the true end."""
        self.close()
        return self._decode_due()

    def _decode_due(self) -> list[np.ndarray]:
        chunks = []
        while (job := self.take_job()) is not None:
            chunks.extend(decode_jobs(self.decoder, [job]))
        return chunks

    def _trim(self) -> None:
        """Drop frames no future window needs (those before the next left context)."""
        keep_from = max(0, self.planner.emitted - self.config.left_context)
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
