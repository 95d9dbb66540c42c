"""DeviceStreamState.sample_and_advance with the v2 rules (device_rules.py) == SegmentState.advance
(REF's state machine, policy.py), row by row.

Logits are built with few competing ids so RAS hits often, and EOS is planted now and then so
ramp-outs start at various codebooks; frame caps end other streams. The RAS candidate and the
sampled token the device must have used are recomputed on the host from the same counter-based
noise (a pure function of seed and column index; tests/engine/models/conftest.py).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from higgs_stream.engine.gpu_sampling import IGNORED, LENGTH, RUNNING, STOP, DeviceStreamState, StreamStart
from higgs_stream.engine.models.higgs_v2.device_rules import V2DeviceRules
from higgs_stream.engine.models.higgs_v2.policy import SegmentState
from higgs_stream.engine.request import SamplingParams

K, V = 8, 1026
PARAMS = [
    SamplingParams(temperature=0.0, ras_window=7, ras_max_repeat=2, seed=11),
    SamplingParams(temperature=0.0, ras_window=3, ras_max_repeat=1, seed=12),
    SamplingParams(temperature=0.0, ras_window=0, seed=13),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.8, ras_window=16, ras_max_repeat=3, seed=2**62 + 5),
    SamplingParams(temperature=1.3, ras_window=7, seed=0),
]
MAX_FRAMES = [40, 6, 25, 12, 9]


# fused: the rules' integer part compiled (RowRules.fuse, torch.compile on this CPU), the same oracle
@pytest.mark.parametrize("seed,fused", [(0, False), (1, False), (2, False), (0, True)])
def test_matches_segment_state(seed, fused, device_oracle):
    rng = np.random.default_rng(seed)
    n = len(PARAMS)
    state = DeviceStreamState(num_slots=6, scratch_slots=2, num_codebooks=K, codebook_size=1024, device="cpu",
                              rules=V2DeviceRules(), fuse_rules=fused)
    assert hasattr(state.rules.rows, "_torchdynamo_orig_callable") == fused  # compiled only when asked
    graphs = counters["stats"]["unique_graphs"]  # the fused rules compiled at construction, not in a step
    slots = [4, 0, 5, 2, 1]
    context = [rng.integers(0, 4, size=(K, int(a))) for a in rng.integers(0, 10, size=n)]
    state.start([StreamStart(s, p, m, c) for s, p, m, c in zip(slots, PARAMS, MAX_FRAMES, context)])
    host = [SegmentState(K, 1024, max_frames=m, ras_window=p.ras_window, ras_max_repeat=p.ras_max_repeat,
                         context_audio=c) for p, m, c in zip(PARAMS, MAX_FRAMES, context)]
    for h in host:
        h.start()
    seen = {RUNNING: 0, STOP: 0, LENGTH: 0}
    for step in range(60):
        logits = torch.full((n + 1, K, V), -30.0)
        logits[:, :, :4] = torch.from_numpy(rng.normal(0, 1, size=(n + 1, K, 4))).float()  # few ids: repeats
        for i in range(n):
            if rng.random() < 0.08:  # plant an EOS on a random codebook
                logits[i, rng.integers(0, K), 1025] = 5.0
        order, packed, noise = device_oracle.step(state, slots, logits, rng)  # + a padded row, IGNORED
        for r, i in enumerate(order):
            h = host[i]
            if h.finished:
                assert packed[r, K] == IGNORED
                continue
            token, cand = device_oracle.draw(logits[i], PARAMS[i], noise[r])
            col = h.advance(token, cand)
            assert packed[r, :K].tolist() == list(col), f"step {step} stream {i}"
            status, want = int(packed[r, K]), device_oracle.status(h)
            assert status == want, f"step {step} stream {i}: status {status}, want {want}"
            seen[status] += 1
    assert seen[STOP] >= 1 and seen[LENGTH] >= 1 and seen[RUNNING] > 30
    assert sum(h.num_ras_resampled for h in host) > 20  # RAS really ran
    for mode in (torch.inference_mode, torch.no_grad, contextlib.nullcontext):  # eager steps, graph captures, scripts
        with mode():
            for b in (1, 3, 2):  # other batch sizes (rows not valid: nothing changes) compile nothing either
                state.sample_and_advance(torch.zeros(b, K, V), torch.arange(b), torch.zeros(b, dtype=torch.bool))
    assert counters["stats"]["unique_graphs"] == graphs


def test_release_and_restart_resets_slot():
    state = DeviceStreamState(num_slots=2, scratch_slots=1, num_codebooks=K, codebook_size=1024, device="cpu",
                              rules=V2DeviceRules())
    p = SamplingParams(temperature=0.0, ras_window=0, seed=1)
    state.start([StreamStart(0, p, 1, np.zeros((K, 0), np.int64))])
    logits = torch.zeros(1, K, V)
    logits[..., 7] = 1.0
    for _ in range(9):  # cap at 1 frame: EOS forced at column 2, ramp-out over 7 more columns
        packed = state.sample_and_advance(logits, torch.tensor([0]), torch.tensor([True]))
    assert packed[0, K] == LENGTH and packed[0, :K].tolist() == [1025] * 7 + [7]
    assert state.sample_and_advance(logits, torch.tensor([0]), torch.tensor([True]))[0, K] == IGNORED
    state.release(0)
    state.start([StreamStart(0, p, 5, np.zeros((K, 0), np.int64))])
    packed = state.sample_and_advance(logits, torch.tensor([0]), torch.tensor([True]))
    assert packed[0].tolist() == [7] + [1024] * 7 + [RUNNING]
