"""DeviceStreamState(rules=QwenDeviceRules, complete=...).sample_and_advance == the host's group-0 rules
(`QwenPolicy.process_logits`, `QwenSegment.advance`) and sampling, row by row.

Group 0's logits favour a few codes (so the repetition penalty changes draws), EOS now and then
(held off for the first 2 frames), and the specials (which must never be drawn); frame caps end
other streams. Each row is completed by a stand-in for the code predictor (groups 1..15: fixed
random projections of the row's hidden state) through the state's `pick`; the host recomputes
every draw from the same counter-based noise (group g of a row: seed ^ g << 40, same column).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.gpu_sampling import IGNORED, DeviceStreamState, StreamStart
from higgs_stream.engine.models.qwen3_tts.config import preset
from higgs_stream.engine.models.qwen3_tts.device_rules import QwenDeviceRules
from higgs_stream.engine.models.qwen3_tts.policy import QwenPolicy
from higgs_stream.engine.request import SamplingParams
from higgs_stream.kernels.sampling_noise import exp_noise_ref

CFG = preset("tiny")
K, V, CB, EOS, H = CFG.num_codebooks, CFG.vocab_size, CFG.codebook_size, CFG.codec_eos_id, 12
PARAMS = [
    SamplingParams(temperature=0.0, seed=11),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=2**62 + 5),
    SamplingParams(temperature=1.3, seed=0),
    SamplingParams(temperature=0.7, top_k=None, top_p=0.9, seed=3),  # top-k off: the groups' clamp to CB
    SamplingParams(temperature=0.0, seed=4),
]
MAX_FRAMES = [40, 3, 25, 12, 30]
PROJ = torch.randn(K - 1, H, CB, generator=torch.Generator().manual_seed(0))  # groups 1..15's stand-in heads


def complete(hidden: torch.Tensor, head: torch.Tensor, pick) -> torch.Tensor:
    """The code predictor's stand-in: group g's logits = hidden @ PROJ[g - 1], each drawn by `pick`."""
    groups = [pick(g, hidden.float() @ PROJ[g - 1]) for g in range(1, K)]
    return torch.cat([head, torch.stack(groups, dim=1)], dim=1)  # [B, K]


def host_pick(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor, vocab: int,
              device_oracle) -> int:
    """One codebook's draw on the host: logits [vocab], noise [vocab] (top-k clamped to the vocabulary)."""
    if params.greedy:
        return int(logits.argmax())
    padded = torch.cat([noise[None], noise[None]])[:, None]  # [2, 1, vocab]: the draw reads row 0
    capped = params if params.top_k is None or params.top_k <= vocab else None
    token, _ = device_oracle.draw(logits[None], capped or params, padded)
    return token[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_host_rules_and_sampling(seed, device_oracle):
    rng = np.random.default_rng(seed)
    n = len(PARAMS)
    rules = QwenDeviceRules(CFG)
    state = DeviceStreamState(num_slots=6, scratch_slots=2, num_codebooks=K, codebook_size=CB, device="cpu",
                              rules=rules, vocab=V, complete=complete)
    assert rules.penalty != 1.0  # the fixture's generation config has a repetition penalty to check
    slots = [4, 0, 5, 2, 1]
    state.start([StreamStart(s, p, m, np.zeros((K, 0), np.int64)) for s, p, m in zip(slots, PARAMS, MAX_FRAMES)])
    policy = QwenPolicy(CFG, None)
    host = [policy.new_segment(None, p, m) for p, m in zip(PARAMS, MAX_FRAMES)]
    ends = {"stop": 0, "length": 0}
    repeats = 0
    for step in range(50):
        logits = torch.full((n + 1, 1, V), -4.0)
        logits[:, 0, :6] = torch.from_numpy(rng.normal(0, 1, size=(n + 1, 6))).float()  # few codes: repeats
        logits[:, 0, CB:] = torch.from_numpy(rng.normal(2, 1, size=(n + 1, V - CB))).float()  # specials: suppressed
        logits[:, 0, EOS] = -2.0
        for i in (0, 2, 4):  # streams 1 and 3 end by their frame caps
            if rng.random() < 0.05:
                logits[i, 0, EOS] = 8.0
        hidden = torch.from_numpy(rng.normal(0, 1, size=(n + 1, H))).float()
        order = rng.permutation(n)
        rows = [slots[i] for i in order] + [state.num_slots]  # + a padded row on a scratch slot
        ncols = state.ncols[rows].clone()
        packed = state.sample_and_advance(logits[list(order) + [n]], torch.tensor(rows),
                                          torch.tensor([True] * n + [False]), hidden[list(order) + [n]])
        assert packed[-1, K] == IGNORED
        for r, i in enumerate(order):
            seg, p = host[i], PARAMS[i]
            if seg.finished:
                assert packed[r, K] == IGNORED
                continue
            processed = policy.process_logits(logits[i : i + 1], [seg])[0, 0]  # [V]
            noise0 = exp_noise_ref(torch.tensor([p.seed]), ncols[r : r + 1], 2 * V)[0, :V]
            g0 = host_pick(processed, p, noise0, V, device_oracle)
            want = [g0]
            for g in range(1, K):
                lg = hidden[i].float() @ PROJ[g - 1]
                noise = exp_noise_ref(torch.tensor([p.seed ^ (g << 40)]), ncols[r : r + 1], CB)[0]
                want.append(host_pick(lg, p, noise, CB, device_oracle))
            repeats += g0 in seg.seen
            assert packed[r, :K].tolist() == want, f"step {step} stream {i}"
            frames = seg.advance(want)
            assert frames == ([] if g0 == EOS else [tuple(want)])
            assert int(packed[r, K]) == device_oracle.status(seg), f"step {step} stream {i}"
            if seg.finished:
                ends[seg.reason] += 1
    assert ends["stop"] >= 1 and ends["length"] >= 1 and repeats > 5
    assert not rules.seen[[state.num_slots, state.num_slots + 1]].any()  # padded rows leave no trace


def test_eos_is_held_off_for_two_frames_and_specials_never_drawn():
    rules = QwenDeviceRules(CFG)
    state = DeviceStreamState(num_slots=1, scratch_slots=1, num_codebooks=K, codebook_size=CB, device="cpu",
                              rules=rules, vocab=V, complete=complete)
    state.start([StreamStart(0, SamplingParams(temperature=0.0, seed=1), 50, np.zeros((K, 0), np.int64))])
    logits = torch.zeros(1, 1, V)
    logits[0, 0, EOS] = 9.0
    logits[0, 0, CB + 3] = 20.0  # a special id: suppressed
    got = [state.sample_and_advance(logits, torch.tensor([0]), torch.tensor([True]), torch.zeros(1, H))[0]
           for _ in range(3)]
    assert [int(r[0]) for r in got[:2]] != [EOS, EOS] and all(int(r[0]) < CB for r in got[:2])
    assert int(got[2][0]) == EOS and int(got[2][K]) == 1  # STOP
