"""engine/codec/step_graphs.py on the CPU: the bucket choice, the static input layout and the replay-vs-eager
comparison that the Higgs and Qwen3-TTS streaming decoders' CUDA graphs share (the capture itself: their GPU
tests)."""

import pytest
import torch
from higgs_stream.engine.codec import streaming
from higgs_stream.engine.codec.step_graphs import (
    CAPTURE_TOLERANCE,
    bucket_keys,
    input_size,
    replay_diff,
    smallest_bucket,
    split_inputs,
    stage_inputs,
)
from higgs_stream.engine.errors import ConfigError


def test_the_higgs_decoder_exports_the_shared_tolerance():
    assert streaming.CAPTURE_TOLERANCE is CAPTURE_TOLERANCE == 1e-5


def test_bucket_keys_and_their_checks():
    assert bucket_keys([4, 1], [8, 2, 8], max_slots=4) == [(1, 2), (1, 8), (4, 2), (4, 8)]
    assert bucket_keys([], [1], max_slots=4) == []
    for bad in ([0], [5], [1.0]):
        with pytest.raises(ConfigError, match="batch buckets"):
            bucket_keys(bad, [1], max_slots=4)
    for bad in ([0], [-1], ["2"]):
        with pytest.raises(ConfigError, match="frame buckets"):
            bucket_keys([1], bad, max_slots=4)


def test_smallest_bucket_pads_least():
    keys = bucket_keys([1, 4, 16], [1, 8, 25], max_slots=16)
    assert smallest_bucket(keys, 1, 1) == (1, 1)
    assert smallest_bucket(keys, 2, 1) == (4, 1)
    assert smallest_bucket(keys, 2, 5) == (4, 8)
    assert smallest_bucket(keys, 1, 9) == (1, 25)
    assert smallest_bucket(keys, 5, 25) == (16, 25)
    assert smallest_bucket(keys, 17, 1) is None and smallest_bucket(keys, 1, 26) is None
    assert smallest_bucket([(2, 9), (16, 1)], 1, 1) == (16, 1)  # fewest row-frames (16 < 18) ...
    assert smallest_bucket([(16, 1), (4, 4), (2, 8)], 1, 1) == (2, 8)  # ... then the smaller key


def test_stage_inputs_writes_rows_then_padding_and_split_reads_them_back():
    key, q = (4, 5), 3
    inp = torch.full((input_size(key, q, 3),), -7, dtype=torch.long)
    assert inp.numel() == 4 * 3 * 5 + 3 * 4
    codes = torch.arange(2 * q * 7).view(2, q, 7)  # wider than the bucket: its first 5 columns are used
    stage_inputs(inp, key, codes, ([2, 0], [5, 1], [10, 0]), (9, 0, 0))
    got, meta = split_inputs(inp, key, q)
    assert got.shape == (4, q, 5) and meta.shape == (3, 4)
    assert torch.equal(got[:2], codes[:, :, :5])
    assert meta.tolist() == [[2, 0, 9, 9], [5, 1, 0, 0], [10, 0, 0, 0]]
    narrow = torch.ones(1, q, 2, dtype=torch.int32)  # fewer columns and another int dtype
    stage_inputs(inp, key, narrow, ([3], [2], [0]), (9, 0, 0))
    got, meta = split_inputs(inp, key, q)
    assert torch.equal(got[0, :, :2], torch.ones(q, 2, dtype=torch.long))
    assert meta.tolist() == [[3, 9, 9, 9], [2, 0, 0, 0], [0, 0, 0, 0]]
    stage_inputs(inp, key, torch.zeros(0, q, 0, dtype=torch.long), ([], [], []), (9, 0, 0))  # all padding
    assert split_inputs(inp, key, q)[1].tolist() == [[9] * 4, [0] * 4, [0] * 4]
    with pytest.raises(AssertionError):
        stage_inputs(inp, key, codes, ([2, 0], [5, 1]), (9, 0))  # 2 meta rows: another bucket's layout


def test_replay_diff_runs_both_from_the_same_states():
    arena = [torch.zeros(5, 2), torch.zeros(5, 3, 1), torch.zeros(5, 3, 0)]  # a layer may keep no history
    start = [torch.randn(3, 2, generator=torch.Generator().manual_seed(0)), torch.ones(3, 3, 1), torch.zeros(3, 3, 0)]
    staged = []

    def step(scale: float = 1.0) -> torch.Tensor:  # an in-place arena update, as a decoder step
        arena[0][:3] += 1.0
        arena[1][:3] *= 2.0 * scale
        return arena[0][:3].sum(1) * scale

    same = replay_diff(arena, start, 3, lambda: staged.append(1), step, step)
    assert same == 0.0 and len(staged) == 2  # inputs staged before each run
    off = replay_diff(arena, start, 3, lambda: None, step, lambda: step(1.0 + 1e-3))
    assert off == pytest.approx(1e-3, rel=1e-3)  # output and states differ by 1e-3 of peak
    assert off > CAPTURE_TOLERANCE
    assert torch.equal(arena[0][3:], torch.zeros(2, 2)), "slots past start_states are not touched"
