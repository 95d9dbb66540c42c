"""DeviceStreamState(rules=V3DeviceRules).sample_and_advance == V3Segment.advance (sglang-omni's row rules), row by row.

EOC is planted on codebook 0 now and then, inside the ramp-up too (where v3 ignores it), and BOC
competes with the codes, so countdowns start at various rows; frame caps end other streams, some
in the middle of a countdown. The sampled token the device must have used is recomputed on the
host from the same counter-based noise (tests/engine/models/conftest.py). RAS settings in the
requests must have no effect.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.gpu_sampling import IGNORED, LENGTH, RUNNING, STOP, DeviceStreamState, StreamStart
from higgs_stream.engine.models.higgs_v3.device_rules import V3DeviceRules
from higgs_stream.engine.models.higgs_v3.policy import V3Segment
from higgs_stream.engine.request import SamplingParams

K, V, BOC, EOC = 8, 1026, 1024, 1025
PARAMS = [
    SamplingParams(temperature=0.0, ras_window=7, ras_max_repeat=1, seed=11),  # RAS would fire often: ignored
    SamplingParams(temperature=0.0, ras_window=0, seed=12),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.8, ras_window=40, seed=2**62 + 5),  # > the device window
    SamplingParams(temperature=1.3, seed=0),
    SamplingParams(temperature=0.0, seed=3),
]
MAX_FRAMES = [40, 3, 25, 12, 9]


def device_state(num_slots: int = 6, scratch: int = 2, fused: bool = False) -> DeviceStreamState:
    return DeviceStreamState(num_slots=num_slots, scratch_slots=scratch, num_codebooks=K, codebook_size=1024,
                             device="cpu", rules=V3DeviceRules(K), fuse_rules=fused)


# fused: the rules compiled (RowRules.fuse, torch.compile on this CPU), the same oracle
@pytest.mark.parametrize("seed,fused", [(0, False), (1, False), (2, False), (0, True)])
def test_matches_v3_segment(seed, fused, device_oracle):
    rng = np.random.default_rng(seed)
    n = len(PARAMS)
    state = device_state(fused=fused)
    assert hasattr(state.rules.rows, "_torchdynamo_orig_callable") == fused  # compiled only when asked
    slots = [4, 0, 5, 2, 1]
    empty = np.zeros((K, 0), np.int64)
    state.start([StreamStart(s, p, m, empty) for s, p, m in zip(slots, PARAMS, MAX_FRAMES)])
    host = [V3Segment(K, 1024, max_frames=m) for m in MAX_FRAMES]
    for h in host:
        assert h.start() == []  # no forced start row (the device still counts it as column 0)
    seen = {RUNNING: 0, STOP: 0, LENGTH: 0}
    eoc_in_ramp = 0
    for step in range(60):
        logits = torch.full((n + 1, K, V), -30.0)
        logits[:, :, :3] = torch.from_numpy(rng.normal(0, 1, size=(n + 1, K, 3))).float()  # few ids: repeats
        logits[:, :, BOC] = torch.from_numpy(rng.normal(-1, 1, size=(n + 1, K))).float()
        for i in range(n):
            if rng.random() < 0.1:  # EOC on codebook 0
                logits[i, 0, EOC] = 6.0
                eoc_in_ramp += len(host[i].state.rows) < K and not host[i].finished
        order, packed, noise = device_oracle.step(state, slots, logits, rng)  # + a padded row, IGNORED
        for r, i in enumerate(order):
            h = host[i]
            if h.finished:
                assert packed[r, K] == IGNORED
                continue
            token, _ = device_oracle.draw(logits[i], PARAMS[i], noise[r])
            cols = h.advance(token)
            assert cols == [tuple(packed[r, :K].tolist())], f"step {step} stream {i}"
            status, want = int(packed[r, K]), device_oracle.status(h)
            assert status == want, f"step {step} stream {i}: status {status}, want {want}"
            seen[status] += 1
    assert seen[STOP] >= 1 and seen[LENGTH] >= 1 and seen[RUNNING] > 30
    assert eoc_in_ramp >= 1  # EOC inside the ramp-up was offered (and ignored by both)
    assert any(h.state.eoc_row is not None and h.reason == "length" for h in host)  # the cap cut a countdown


def test_ramp_countdown_and_cap_by_hand():
    """Greedy, EOC always on codebook 0: rows 0..7 ramp (EOC kept but ignored), row 8 starts the
    countdown, row 14 is the last (6 rows later): 15 rows = 8 frames. A cap of 3 frames ends at 10 rows."""
    state = device_state(num_slots=2, scratch=0)
    p = SamplingParams(temperature=0.0, seed=1)
    empty = np.zeros((K, 0), np.int64)
    state.start([StreamStart(0, p, 100, empty), StreamStart(1, p, 3, empty)])
    logits = torch.zeros(2, K, V)
    logits[:, :, 7] = 1.0
    logits[:, 0, EOC] = 2.0
    out = [state.sample_and_advance(logits, torch.tensor([0, 1]), torch.tensor([True, True])) for _ in range(16)]
    rows0 = [o[0].tolist() for o in out]
    assert rows0[0] == [EOC] + [BOC] * 7 + [RUNNING] and rows0[7] == [EOC] + [7] * 7 + [RUNNING]
    assert [r[K] for r in rows0[:15]] == [RUNNING] * 14 + [STOP] and rows0[15][K] == IGNORED
    rows1 = [o[1].tolist() for o in out]
    assert [r[K] for r in rows1[:10]] == [RUNNING] * 9 + [LENGTH] and rows1[10][K] == IGNORED
    assert state.ncols.tolist() == [16, 11]  # the BOC column + the rows
