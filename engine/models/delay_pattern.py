"""The delay pattern between codec frames [K, T] and talker columns [K, L] (numpy, host side).

Codebook k is shifted right by k: column c holds codebook k of frame c - k. Prompt audio is
wrapped as BOS frame + codes + EOS frame and then delayed, so T frames take T + K + 1 columns
(T + 9 for K = 8). A generated segment of L columns (its first column the forced all-BOS one, its
last the end of the EOS ramp-out) decodes to L - K - 1 frames: revert, then drop the BOS frame
and the EOS frame (REF `revert_delay_pattern(...)[:, 1:-1]`).

Stray stream ids in decoded frames. The model may sample BOS (1024) or EOS (1025) inside a frame
that carries real audio; REF clips them to 1023. We instead repeat the last valid code of the
same codebook (a causal forward fill, so streaming and offline decoding agree), and use code 0
when a codebook has had no valid code yet. `StrayFill` does this for one stream.
"""

from __future__ import annotations

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


def revert_delay_pattern(cols: np.ndarray) -> np.ndarray:
    """[K, L] -> [K, L - K + 1]: frame f takes codebook k from column f + k."""
    assert cols.ndim == 2, f"columns must be [K, L], got shape {cols.shape}"
    k_cb, length = cols.shape
    n = length - k_cb + 1
    assert n >= 0, f"{length} columns hold no complete frame for {k_cb} codebooks"
    return np.stack([cols[k, k : k + n] for k in range(k_cb)]).astype(np.int64, copy=False)


def delayed_prompt_audio(codes: np.ndarray, bos: int = STREAM_BOS, eos: int = STREAM_EOS) -> np.ndarray:
    """Prompt audio [K, T] -> the [K, T + K + 1] columns the talker reads (BOS/EOS-wrapped, delayed)."""
    assert codes.ndim == 2 and codes.shape[1] >= 1, f"codes must be [K, T>=1], got shape {codes.shape}"
    k_cb = codes.shape[0]
    wrapped = np.concatenate(
        [np.full((k_cb, 1), bos, np.int64), codes.astype(np.int64), np.full((k_cb, 1), eos, np.int64)], axis=1
    )
    return build_delay_pattern(wrapped, bos, eos)


def columns_to_frames(
    cols: np.ndarray, *, ended: bool = True, codebook_size: int = STREAM_BOS
) -> np.ndarray:
    """Generated columns [K, L] -> codec codes [K, F] in 0..codebook_size-1.

    ended=True (the stream finished through its EOS ramp-out): F = L - K - 1, the last reverted
    frame (it holds the EOS) is dropped. ended=False (cut short, e.g. cancelled): F = L - K, every
    complete frame after the BOS frame is kept. Stray BOS/EOS become the codebook's last valid code.
    """
    k_cb, length = cols.shape
    if length < k_cb:
        return np.zeros((k_cb, 0), dtype=np.int64)
    frames = revert_delay_pattern(cols)[:, 1:]  # drop the BOS frame
    if ended:
        frames = frames[:, :-1]
    fill = StrayFill(k_cb, codebook_size)
    return fill(frames)


def stack_rows(rows, k: int) -> np.ndarray:
    """Rows or columns (each K ids) -> [K, L] int64; L may be 0."""
    return np.array(rows, dtype=np.int64).T.reshape(k, len(rows))


def count_stray(frames: np.ndarray, codebook_size: int = STREAM_BOS) -> int:
    """How many entries of reverted frames [K, F] are not real codes."""
    return int(((frames < 0) | (frames >= codebook_size)).sum())


class StrayFill:
    """Causal replacement of stray ids, per codebook; carry one instance through a stream."""

    def __init__(self, num_codebooks: int, codebook_size: int = STREAM_BOS) -> None:
        self.codebook_size = codebook_size
        self.last_valid = np.full(num_codebooks, STRAY_FALLBACK_CODE, dtype=np.int64)
        self.num_replaced = 0

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        """[K, F] -> [K, F] with every id outside 0..codebook_size-1 replaced."""
        out = np.array(frames, dtype=np.int64, copy=True)
        for f in range(out.shape[1]):
            col = out[:, f]
            bad = (col < 0) | (col >= self.codebook_size)
            if bad.any():
                col[bad] = self.last_valid[bad]
                self.num_replaced += int(bad.sum())
            self.last_valid = col.copy()
        return out


class ColumnReverter:
    """Incremental `columns_to_frames`: push columns as they are generated, get frames back.

    Frame f is complete once column f + K - 1 arrives. Pushing the stream's final column with
    final=True drops the frame completed by it (the EOS frame), so the concatenation of all
    returned frames equals `columns_to_frames(all_columns)` exactly.
    """

    def __init__(self, num_codebooks: int = 8, codebook_size: int = STREAM_BOS) -> None:
        self.k = num_codebooks
        self._recent = np.zeros((num_codebooks, num_codebooks), dtype=np.int64)  # last K columns
        self._count = 0
        self._fill = StrayFill(num_codebooks, codebook_size)

    def push(self, column: np.ndarray, final: bool = False) -> np.ndarray:
        """One column [K] -> [K, 0] or [K, 1] new frames."""
        assert column.shape == (self.k,), f"column must be [{self.k}], got shape {column.shape}"
        self._recent = np.roll(self._recent, -1, axis=1)
        self._recent[:, -1] = column
        self._count += 1
        frame_index = self._count - self.k  # frame completed by this column (if >= 0)
        if frame_index < 1 or final:  # not complete yet, the BOS frame, or the EOS frame
            return np.zeros((self.k, 0), dtype=np.int64)
        frame = self._recent[np.arange(self.k), np.arange(self.k)][:, None]  # codebook k from column f + k
        return self._fill(frame)

    @property
    def num_replaced(self) -> int:
        return self._fill.num_replaced
