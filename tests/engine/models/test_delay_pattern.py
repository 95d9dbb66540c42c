"""Delay pattern build/revert, prompt-audio wrapping, the frame writer (columns -> frames) and stray replacement."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from transformers import HiggsAudioV2Processor

from higgs_stream.engine.models.delay_pattern import (
    STREAM_BOS as B,
    STREAM_EOS as E,
    DelayWriter,
    build_delay_pattern,
    columns_to_frames,
    count_stray,
    delayed_prompt_audio,
    revert_delay_pattern,
)


def test_build_hand_example():
    codes = np.array([[10, 11], [20, 21], [30, 31]])
    expected = np.array([
        [10, 11, E, E],
        [B, 20, 21, E],
        [B, B, 30, 31],
    ])
    np.testing.assert_array_equal(build_delay_pattern(codes), expected)
    np.testing.assert_array_equal(revert_delay_pattern(expected), codes)


def test_round_trip_random():
    rng = np.random.default_rng(0)
    for s in (1, 2, 7, 50):
        codes = rng.integers(0, 1024, size=(8, s))
        cols = build_delay_pattern(codes)
        assert cols.shape == (8, s + 7)
        np.testing.assert_array_equal(revert_delay_pattern(cols), codes)


def test_matches_transformers_processor():
    """Same columns as HiggsAudioV2Processor.build_delay_pattern / revert_delay_pattern."""
    ns = SimpleNamespace(audio_stream_bos_id=B, audio_stream_eos_id=E)
    codes = np.random.default_rng(1).integers(0, 1024, size=(8, 13))
    theirs = HiggsAudioV2Processor.build_delay_pattern(ns, torch.from_numpy(codes)[None])[0].numpy()
    np.testing.assert_array_equal(build_delay_pattern(codes), theirs)
    back = HiggsAudioV2Processor.revert_delay_pattern(ns, torch.from_numpy(theirs).T).T.numpy()
    np.testing.assert_array_equal(revert_delay_pattern(theirs), back)


def test_prompt_audio_is_T_plus_9_columns():
    codes = np.random.default_rng(2).integers(0, 1024, size=(8, 5))
    cols = delayed_prompt_audio(codes)
    assert cols.shape == (8, 5 + 9)
    assert (cols[:, 0] == B).all() and (cols[:, -1] == E).all()
    for c in range(cols.shape[1]):
        for k in range(8):
            f = c - k - 1  # frame index of codes (the BOS frame is -1, the EOS frame is T)
            want = B if f < 0 else (E if f >= 5 else codes[k, f])
            assert cols[k, c] == want, (k, c)


def test_columns_to_frames_drops_bos_and_eos_frames():
    frames = np.random.default_rng(3).integers(0, 1024, size=(8, 6))
    cols = delayed_prompt_audio(frames)  # what a finished segment of 6 frames looks like: L = 15
    assert cols.shape[1] - 9 == 6
    np.testing.assert_array_equal(columns_to_frames(cols), frames)
    assert columns_to_frames(cols[:, :9]).shape == (8, 0)
    # cut short (no EOS ramp-out yet): every complete frame after the BOS frame is kept
    np.testing.assert_array_equal(columns_to_frames(cols[:, :12], ended=False), frames[:, :4])


def test_stray_ids_take_the_previous_valid_code_not_1023():
    frames = np.array([
        [5, B, 7, E],  # strays after valid codes -> previous valid code
        [E, 3, 3, 4],  # stray in the first frame -> fallback 0
    ])
    full = np.zeros((8, 4), np.int64)
    full[:2] = frames
    out = columns_to_frames(delayed_prompt_audio(full))
    assert out[0].tolist() == [5, 5, 7, 7]
    assert out[1].tolist() == [0, 3, 3, 4]
    assert count_stray(frames) == 3
    assert out.max() < 1024 and 1023 not in out


def test_delay_writer_equals_offline():
    rng = np.random.default_rng(4)
    frames = rng.integers(0, 1024, size=(8, 20))
    frames[rng.random(frames.shape) < 0.1] = B  # sprinkle strays
    frames[rng.random(frames.shape) < 0.05] = E
    cols = delayed_prompt_audio(frames)
    cols[:, 0] = B  # (already) the forced BOS column, which the wrapped writer pushes itself
    rev = DelayWriter(8, wrapped=True)
    got = [rev.push(cols[:, i].tolist(), final=(i == cols.shape[1] - 1)) for i in range(1, cols.shape[1])]
    streamed = np.array([f for f in got if f is not None]).T
    np.testing.assert_array_equal(streamed, columns_to_frames(cols))
    assert rev.num_replaced == count_stray(frames)
    # not finished: same as the offline ended=False view
    rev2 = DelayWriter(8, wrapped=True)
    part = [rev2.push(cols[:, i].tolist()) for i in range(1, 15)]
    np.testing.assert_array_equal(np.array([f for f in part if f is not None]).T,
                                  columns_to_frames(cols[:, :15], ended=False))


def test_wrapped_writer_yields_frame_n_with_column_n_plus_k():
    """v2: the BOS column is column 0 (the writer's own), frame n (0-based, BOS frame dropped) comes
    with column n + K, and the final column yields nothing (its frame is the EOS frame)."""
    frames = np.random.default_rng(5).integers(0, 1024, size=(8, 12))
    cols = delayed_prompt_audio(frames)  # [8, 21]
    rev = DelayWriter(8, wrapped=True)
    assert rev.num_columns == 1
    at = {i: rev.push(cols[:, i].tolist(), final=i == cols.shape[1] - 1) for i in range(1, cols.shape[1])}
    assert [i for i, f in at.items() if f is not None] == [n + 8 for n in range(12)]
    assert all(at[n + 8] == frames[:, n].tolist() for n in range(12))


def test_unwrapped_writer_reverts_rows_and_keeps_the_last_frame():
    """v3: rows are delayed without BOS/EOS frames; R rows give R - K + 1 frames, the final row's included."""
    rng = np.random.default_rng(6)
    frames = rng.integers(0, 1024, size=(8, 9))
    rows = build_delay_pattern(frames)  # [8, 16]: BOC above the diagonal, EOC below
    rev = DelayWriter(8, wrapped=False)
    got = [rev.push(rows[:, r].tolist(), final=r == rows.shape[1] - 1) for r in range(rows.shape[1])]
    assert [r for r, f in enumerate(got) if f is not None] == list(range(7, 16))  # row r completes frame r - 7
    np.testing.assert_array_equal(np.array([f for f in got if f is not None]).T, frames)
    assert rev.num_replaced == 0
    # strays inside a frame: the codebook's previous valid code (0 before any)
    rows[0, 0] = B
    rows[1, 9] = E  # frame 8, codebook 1
    rev = DelayWriter(8, wrapped=False)
    out = np.array([f for f in (rev.push(c) for c in rows.T.tolist()) if f is not None]).T
    assert out[0, 0] == 0 and out[1, 8] == frames[1, 7] and rev.num_replaced == 2
