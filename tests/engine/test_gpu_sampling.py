"""DeviceStreamState.start: every field of every starting stream lands in its slot (more streams than
one staged apply holds, RAS windows seeded from context audio, greedy and sampled parameters), other
slots untouched; on CUDA the graph-replayed apply (padded with scratch slots) leaves the same state as
the eager one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.gpu_sampling import START_ROWS, STOP, DeviceStreamState, StreamStart
from higgs_stream.engine.models.higgs_v2.device_rules import V2DeviceRules
from higgs_stream.engine.request import SamplingParams

K, CB, SLOTS = 8, 1024, 16
PARAMS = ("ras_window", "ras_max_repeat", "seed", "temperature", "top_k", "top_p_cut", "greedy", "done")
FIELDS = ("last_col", "ncols", "num_delay", "num_remaining", "stop_reason", "done", "cap_column", "window",
          "win_pos", "win_fill", "ras_window", "ras_max_repeat", "seed", "temperature", "top_k", "top_p_cut", "greedy")


def starts(n: int) -> list[StreamStart]:
    rng = np.random.default_rng(n)
    out = []
    for i in range(n):
        params = SamplingParams(temperature=0.0 if i % 3 == 0 else 0.5 + 0.1 * i, top_k=[None, 7, 50][i % 3],
                                top_p=[1.0, 0.9, 0.5][i % 3], ras_window=[0, 3, 16][i % 3], ras_max_repeat=1 + i % 2,
                                seed=2**40 + i)
        out.append(StreamStart(SLOTS - 1 - i, params, 10 + i, rng.integers(0, CB, (K, i % 5))))
    return out


def state(device: str) -> DeviceStreamState:
    return DeviceStreamState(SLOTS, START_ROWS, K, CB, device, rules=V2DeviceRules())


def snapshot(st: DeviceStreamState) -> dict[str, np.ndarray]:
    return {name: getattr(st, name).cpu().numpy().copy() for name in FIELDS}


def test_start_writes_every_field_of_every_stream():
    st = state("cpu")
    before = snapshot(st)
    got = starts(START_ROWS + 3)  # two staged applies
    st.start(got)
    after = snapshot(st)
    for s in got:
        p, r = s.params, s.params.ras_window
        ctx = s.context_audio[:, max(0, s.context_audio.shape[1] - r):].T if r else np.zeros((0, K), np.int64)
        cols = np.concatenate([ctx, np.full((1, K), CB)])  # then the all-BOS start row
        assert after["last_col"][s.slot].tolist() == [CB] * K
        assert np.array_equal(after["window"][s.slot, :len(cols)], cols) and not after["window"][s.slot, len(cols):].any()
        assert (after["win_fill"][s.slot], after["win_pos"][s.slot]) == (len(cols), len(cols) % st.w)
        assert (after["ras_window"][s.slot], after["ras_max_repeat"][s.slot]) == (r, p.ras_max_repeat)
        assert after["seed"][s.slot] == p.seed and after["cap_column"][s.slot] == s.max_frames + 1
        assert after["top_k"][s.slot] == (p.top_k or st.v) and bool(after["greedy"][s.slot]) == p.greedy
        assert after["temperature"][s.slot] == pytest.approx(1.0 if p.greedy else p.temperature)
        assert after["top_p_cut"][s.slot] == pytest.approx(1.0 - p.top_p if p.top_p < 1 else -1.0)
        assert (after["ncols"][s.slot], after["num_delay"][s.slot], after["num_remaining"][s.slot]) == (1, 0, -1)
        assert after["stop_reason"][s.slot] == STOP and not after["done"][s.slot]
    untouched = sorted(set(range(SLOTS)) - {s.slot for s in got})
    for name in FIELDS:
        assert np.array_equal(after[name][untouched], before[name][untouched]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_start_leaves_the_eager_state_on_cuda():
    eager, graphed = state("cuda"), state("cuda")
    fresh = snapshot(graphed)
    graphed.capture_start()
    for n in (1, START_ROWS, START_ROWS + 3):
        eager.start(starts(n))
        graphed.start(starts(n))
        a, b = snapshot(eager), snapshot(graphed)
        for name in FIELDS:  # real slots equal; scratch slots keep a fresh state's parameters
            assert np.array_equal(a[name][:SLOTS], b[name][:SLOTS]), (n, name)
            assert name not in PARAMS or np.array_equal(b[name][SLOTS:], fresh[name][SLOTS:]), (n, name)


def test_padded_applies_leave_scratch_slots_fresh():
    """What the CUDA graph replays (START_ROWS rows, the unused ones on scratch slots), run on the CPU:
    real slots as an unpadded start; scratch slots keep a fresh state's parameters (padded decode rows read
    their sampling parameters: a top-k of 0 indexed out of range on an H100)."""
    padded, plain = state("cpu"), state("cpu")
    fresh = snapshot(padded)
    padded._start_graph = type("Replay", (), {"replay": lambda self: padded._apply_start(START_ROWS)})()
    for n in (1, START_ROWS + 3):
        padded.start(starts(n))
        plain.start(starts(n))
        a, b = snapshot(plain), snapshot(padded)
        for name in FIELDS:  # (scratch slots' counters are scratch: padded decode rows write them every step)
            assert np.array_equal(a[name][:SLOTS], b[name][:SLOTS]), (n, name)
            assert name not in PARAMS or np.array_equal(b[name][SLOTS:], fresh[name][SLOTS:]), (n, name)


def test_release_marks_only_its_slot_done():
    st = state("cpu")
    st.start(starts(3))
    st.release(SLOTS - 2)
    done = st.done.cpu().numpy()
    assert done[SLOTS - 2] and not done[SLOTS - 1] and not done[SLOTS - 3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_does_not_wait_for_the_device():
    """A finished stream's release is a fill launched on the stream, not a host copy that waits for the
    steps in flight (torch's sync debug mode raises on a synchronizing call)."""
    st = state("cuda")
    st.start(starts(3))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st.release(SLOTS - 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(st.done[SLOTS - 2]) and not bool(st.done[SLOTS - 1])
