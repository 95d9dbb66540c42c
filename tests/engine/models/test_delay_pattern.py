"""Delay pattern build/revert, prompt-audio wrapping, columns -> frames and stray replacement."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from transformers import HiggsAudioV2Processor

from higgs_stream.engine.models.delay_pattern import (
    STREAM_BOS as B,
    STREAM_EOS as E,
    ColumnReverter,
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


def test_column_reverter_equals_offline():
    rng = np.random.default_rng(4)
    frames = rng.integers(0, 1024, size=(8, 20))
    frames[rng.random(frames.shape) < 0.1] = B  # sprinkle strays
    frames[rng.random(frames.shape) < 0.05] = E
    cols = delayed_prompt_audio(frames)
    cols[:, 0] = B  # (already) the forced BOS column
    rev = ColumnReverter(8)
    got = [rev.push(cols[:, i], final=(i == cols.shape[1] - 1)) for i in range(cols.shape[1])]
    streamed = np.concatenate(got, axis=1)
    np.testing.assert_array_equal(streamed, columns_to_frames(cols))
    assert rev.num_replaced == count_stray(frames)
    # not finished: same as the offline ended=False view
    rev2 = ColumnReverter(8)
    part = np.concatenate([rev2.push(cols[:, i]) for i in range(15)], axis=1)
    np.testing.assert_array_equal(part, columns_to_frames(cols[:, :15], ended=False))
