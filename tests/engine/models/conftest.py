"""Helpers shared by the model-family tests: one ragged talker step over slices of test sequences
(`step_batch`), and one decode step of a family's device rules (`DeviceStreamState.sample_and_advance`)
beside its host oracle (the family's policy.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from higgs_stream.engine.batch import StepBatch
from higgs_stream.engine.gpu_sampling import IGNORED, LENGTH, RUNNING, STOP, DeviceStreamState
from higgs_stream.engine.request import SamplingParams
from higgs_stream.engine.sampling import SamplingTensors, warp_logits
from higgs_stream.kernels.sampling_noise import exp_noise_ref


def host_draw(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> tuple[list[int], list[int]]:
    """What the device must sample for one row, logits [K, V] and the step's noise [2, K, V]:
    (token, RAS candidate) per codebook."""
    v = logits.shape[-1]
    st = SamplingTensors.build([params], v, logits.device)
    st = SamplingTensors(st.temperature, st.top_k, st.top_p_cut, st.greedy, True, True)
    probs = warp_logits(logits[None], st).softmax(-1)[0]
    token = logits.argmax(-1) if params.greedy else (probs / noise[0]).argmax(-1)
    cand = (logits.softmax(-1) / noise[1]).argmax(-1)
    return token.tolist(), cand.tolist()


def device_step(state: DeviceStreamState, slots: list[int], logits: torch.Tensor,
                rng: np.random.Generator) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """One `sample_and_advance` over stream i on slots[i] (logits[i]), in a random order, plus one
    padded row (logits[-1]) on the first scratch slot, which must come back IGNORED.
    Returns (order, packed [n + 1, K + 1], noise [n + 1, 2, K, V]): row r is stream order[r]."""
    n, (k, v) = len(slots), logits.shape[1:]
    order = rng.permutation(n)
    rows = [slots[i] for i in order] + [state.num_slots]
    valid = torch.tensor([True] * n + [False])
    noise = exp_noise_ref(state.seed[rows], state.ncols[rows], 2 * k * v).view(-1, 2, k, v)
    packed = state.sample_and_advance(logits[list(order) + [n]], torch.tensor(rows), valid)
    assert packed[-1, k] == IGNORED
    return order, packed, noise


def host_status(segment) -> int:
    """The status the device must report after the host segment's last row."""
    return {"stop": STOP, "length": LENGTH}[segment.reason] if segment.finished else RUNNING


@pytest.fixture(scope="session")
def device_oracle() -> SimpleNamespace:
    """`draw(logits, params, noise)`, `step(state, slots, logits, rng)`, `status(segment)`: see above."""
    return SimpleNamespace(draw=host_draw, step=device_step, status=host_status)


def step_batch(parts: list[tuple[int, Any, int, int]], want_text: bool = True) -> StepBatch:
    """parts: (seq_id, seq, start, stop) -> one ragged step over seq[start:stop] of each (a family
    test's seq holds ids [T], codes [T, K] and is_audio [T]); every sequence wants audio logits."""
    rows = [(seq, torch.arange(start, stop)) for _, seq, start, stop in parts]
    b = len(parts)
    return StepBatch(
        seq_ids=[p[0] for p in parts],
        qo_lens=[stop - start for _, _, start, stop in parts],
        input_ids=torch.cat([seq.ids[r] for seq, r in rows]),
        audio_codes=torch.cat([seq.codes[r] for seq, r in rows]),
        is_audio=torch.cat([seq.is_audio[r] for seq, r in rows]),
        positions=torch.cat([r for _, r in rows]),
        want_text=torch.full((b,), want_text),
        want_audio=torch.ones(b, dtype=torch.bool),
    )


@pytest.fixture(scope="session", name="step_batch")
def step_batch_fixture():
    """`step_batch(parts, want_text=True)`: see above (the talker tests' one ragged step)."""
    return step_batch
