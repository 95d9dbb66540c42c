"""The delay pattern of the Higgs families (v2, v3): codec frames [K, T] <-> talker columns [K, L].

Codebook k is shifted right by k: column c holds codebook k of frame c - k, so frame f is complete
once column f + K - 1 arrives. Prompt audio is wrapped (v2) as BOS frame + codes + EOS frame and
then delayed, so T frames take T + K + 1 columns (T + 9 for K = 8).

Generated audio goes the other way through `DelayWriter`, the one implementation of the revert
(the family's frame writer in the engine; `columns_to_frames` and `revert_delay_pattern` run it
offline):

* v2 (`wrapped=True`): a segment of L columns, its first column the forced all-BOS one (AUDIO_INIT,
  pushed by the writer itself) and its last the end of the EOS ramp-out, decodes to L - K - 1
  frames: the BOS frame and the EOS frame (the one the final column completes) are dropped (REF
  `revert_delay_pattern(...)[:, 1:-1]`).
* v3 (`wrapped=False`): R sampled rows give R - K + 1 frames, every complete one.

Stray stream ids in decoded frames. The model may sample BOS (1024) or EOS (1025) inside a frame
that carries real audio; REF clips them to 1023. We instead repeat the last valid code of the
same codebook (a causal forward fill, so streaming and offline decoding agree), and use code 0
when a codebook has had no valid code yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

STREAM_BOS = 1024
STREAM_EOS = 1025
STRAY_FALLBACK_CODE = 0  # used only when a codebook has produced no valid code yet


def build_delay_pattern(codes: np.ndarray, bos: int = STREAM_BOS, eos: int = STREAM_EOS) -> np.ndarray:
    """[K, S] -> [K, S + K - 1]: out[k, c] = codes[k, c - k], BOS before, EOS after."""
    assert codes.ndim == 2, f"codes must be [K, S], got shape {codes.shape}"
    k_cb, s = codes.shape
    out = np.full((k_cb, s + k_cb - 1), eos, dtype=np.int64)
    for k in range(k_cb):
        out[k, :k] = bos
        out[k, k : k + s] = codes[k]
    return out


def delayed_prompt_audio(codes: np.ndarray, bos: int = STREAM_BOS, eos: int = STREAM_EOS) -> np.ndarray:
    """Prompt audio [K, T] -> the [K, T + K + 1] columns the talker reads (BOS/EOS-wrapped, delayed)."""
    assert codes.ndim == 2 and codes.shape[1] >= 1, f"codes must be [K, T>=1], got shape {codes.shape}"
    k_cb = codes.shape[0]
    wrapped = np.concatenate(
        [np.full((k_cb, 1), bos, np.int64), codes.astype(np.int64), np.full((k_cb, 1), eos, np.int64)], axis=1
    )
    return build_delay_pattern(wrapped, bos, eos)


class DelayWriter:
    """Columns [K] in, complete codec frames [K] out, one stream at a time (plain Python ints: the
    engine runs one per stream per step, where small numpy calls cost more than the arithmetic).

    `wrapped` (v2): the stream starts with the all-BOS column (pushed here, at construction), the
    BOS frame is dropped, and the frame completed by the final column (`push(..., final=True)`,
    the EOS frame) too. `fill_strays=False` returns raw frames (the exact inverse of
    `build_delay_pattern`); otherwise ids outside 0..codebook_size-1 take the codebook's last
    valid code.
    """

    def __init__(self, num_codebooks: int = 8, codebook_size: int = STREAM_BOS, *, wrapped: bool,
                 fill_strays: bool = True) -> None:
        self.k, self.codebook_size = num_codebooks, codebook_size
        self.wrapped, self.fill_strays = wrapped, fill_strays
        self._ring: list[Sequence[int]] = [(0,) * num_codebooks] * num_codebooks  # column c at c % K
        self._count = 0
        self._last_valid = [STRAY_FALLBACK_CODE] * num_codebooks
        self.num_replaced = 0
        if wrapped:
            self.push((codebook_size,) * num_codebooks)  # AUDIO_INIT: the forced all-BOS column

    @property
    def num_columns(self) -> int:
        """Columns pushed so far (v2: the BOS column included)."""
        return self._count

    def push(self, column: Sequence[int], final: bool = False) -> list[int] | None:
        """One column (K ints) -> the frame it completes, or None (none complete yet, or dropped)."""
        k = self.k
        self._ring[self._count % k] = column
        self._count += 1
        f = self._count - k  # frame completed by this column (if >= 0)
        if f < 0 or (self.wrapped and (f == 0 or final)):  # not complete yet, the BOS frame, the EOS frame
            return None
        ring = self._ring
        frame = [ring[(f + j) % k][j] for j in range(k)]
        if self.fill_strays:
            size, last = self.codebook_size, self._last_valid
            for j, v in enumerate(frame):
                if v < 0 or v >= size:
                    frame[j] = last[j]
                    self.num_replaced += 1
            self._last_valid = frame
        return frame


def revert_delay_pattern(cols: np.ndarray) -> np.ndarray:
    """[K, L] -> [K, L - K + 1]: frame f takes codebook k from column f + k (the inverse of
    `build_delay_pattern`; raw ids, strays kept)."""
    assert cols.ndim == 2, f"columns must be [K, L], got shape {cols.shape}"
    k_cb, length = cols.shape
    assert length >= k_cb - 1, f"{length} columns hold no complete frame for {k_cb} codebooks"
    writer = DelayWriter(k_cb, wrapped=False, fill_strays=False)
    frames = [writer.push(col) for col in cols.T.tolist()]
    return stack_rows([f for f in frames if f is not None], k_cb)


def columns_to_frames(
    cols: np.ndarray, *, ended: bool = True, codebook_size: int = STREAM_BOS
) -> np.ndarray:
    """A v2 segment's columns [K, L] (column 0 the all-BOS one) -> codec codes [K, F] in 0..codebook_size-1.

    ended=True (the stream finished through its EOS ramp-out): F = L - K - 1, the last reverted
    frame (it holds the EOS) is dropped. ended=False (cut short, e.g. cancelled): F = L - K, every
    complete frame after the BOS frame is kept. Stray BOS/EOS become the codebook's last valid code.
    """
    k_cb, length = cols.shape
    writer = DelayWriter(k_cb, codebook_size, wrapped=True)  # pushes the BOS column itself
    frames = [writer.push(col, final=ended and i == length - 1) for i, col in enumerate(cols.T.tolist()[1:], 1)]
    return stack_rows([f for f in frames if f is not None], k_cb)


def stack_rows(rows: Sequence[Sequence[int]], k: int) -> np.ndarray:
    """Rows, columns or frames (each K ids) -> [K, L] int64; L may be 0."""
    return np.array(rows, dtype=np.int64).T.reshape(k, len(rows))


def count_stray(frames: np.ndarray, codebook_size: int = STREAM_BOS) -> int:
    """How many entries of reverted frames [K, F] are not real codes."""
    return int(((frames < 0) | (frames >= codebook_size)).sum())
