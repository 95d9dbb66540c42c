"""Batched per-codebook sampling: HF warper parity, distributions, greedy, per-stream seeding."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from higgs_stream.engine.request import GREEDY_BELOW, SamplingParams
from higgs_stream.engine.sampling import SamplingTensors, draw_noise, sample_columns, warp_logits

V = 1026


def hf_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """REF's processor list (transformers order: temperature, top-k, top-p) on one stream's [8, V]."""
    out = logits
    if p.temperature != 1.0:
        out = TemperatureLogitsWarper(float(p.temperature))(None, out)
    if p.top_k is not None:
        out = TopKLogitsWarper(p.top_k)(None, out)
    if p.top_p < 1.0:
        out = TopPLogitsWarper(p.top_p)(None, out)
    return out


def gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_warpers_match_transformers_per_row():
    torch.manual_seed(0)
    params = [
        SamplingParams(temperature=0.7, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.95),
        SamplingParams(temperature=0.3, top_k=3, top_p=1.0),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=1.0),
        SamplingParams(temperature=0.9, top_k=2000, top_p=0.8),  # top_k larger than V
    ]
    logits = torch.randn(len(params), 8, V) * 3
    logits[0, 0, 10:20] = logits[0, 0, 5]  # ties
    st = SamplingTensors.build(params, V, torch.device("cpu"))
    ours = warp_logits(logits, st)
    for i, p in enumerate(params):
        torch.testing.assert_close(ours[i], hf_warp(logits[i], p), rtol=0, atol=0)
    kept = torch.isfinite(ours).sum(-1)
    assert (kept[2] == 3).all() and (kept[4] == V).all() and (kept[3] < V).all()


def test_sampled_frequencies_follow_the_warped_distribution():
    rows = 64
    logits = torch.full((rows, 8, V), -30.0)
    logits[:, :, :4] = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    p = SamplingParams(temperature=1.0, top_p=1.0)
    st = SamplingTensors.build([p] * rows, V, torch.device("cpu"))
    g = gens(*range(rows))
    counts = torch.zeros(V)
    for _ in range(5):
        counts += torch.bincount(sample_columns(logits, st, g)[:, 0].flatten(), minlength=V)
    freq = counts / counts.sum()  # 2560 draws: sigma <= 0.01
    assert (freq[:4] - torch.tensor([0.5, 0.25, 0.15, 0.1])).abs().max() < 0.04
    assert counts[4:].sum() == 0


def test_greedy_takes_raw_argmax_and_ras_candidate_samples_raw_logits():
    rows = 64
    logits = torch.full((rows, 8, V), -30.0)
    logits[:, :, 3] = 1.0
    logits[:, :, 4] = 0.0  # raw softmax: 3 -> 0.731, 4 -> 0.269
    params = [SamplingParams(temperature=0.0, top_k=1), SamplingParams(temperature=0.05, top_k=1)] * (rows // 2)
    st = SamplingTensors.build(params, V, torch.device("cpu"))
    g = gens(*range(rows))
    ras = []
    for _ in range(5):
        out = sample_columns(logits, st, g)  # [S, 2, 8]
        assert (out[:, 0] == 3).all()  # greedy / top_k=1: always the argmax
        ras.append(out[:, 1])
    ras = torch.stack(ras)  # [5, S, 8]
    for parity in (0, 1):  # greedy rows and sampled rows alike: the RAS draw ignores temperature/top-k
        share4 = (ras[:, parity::2] == 4).float().mean()
        assert abs(share4 - 0.269) < 0.04, share4  # 1280 draws each: sigma 0.012


def test_temperatures_too_small_for_fp32_are_greedy():
    """Below GREEDY_BELOW a temperature samples as greedy does (5e-324 was 0 in fp32: logits / 0, NaN probabilities
    and a draw over them, found by a probe); at it and above, sampling as before."""
    logits = torch.randn(6, 8, V)
    tiny = [SamplingParams(temperature=t) for t in (5e-324, 1e-45, 1e-300, 1e-30, 9.99e-7)]
    st = SamplingTensors.build(tiny + [SamplingParams(temperature=0.0)], V, torch.device("cpu"))
    assert st.greedy.all() and (st.temperature == 1.0).all()
    out = sample_columns(logits, st, gens(*range(6)))
    assert torch.equal(out[:, 0], logits.argmax(dim=-1))
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy


def test_rows_are_independent_of_the_batch():
    """A stream's draws depend only on its logits and its generator, not on its batch neighbours."""
    torch.manual_seed(3)
    logits = torch.randn(3, 8, V)
    params = [SamplingParams(temperature=0.8, top_k=40), SamplingParams(), SamplingParams(temperature=1.2)]
    batch_g = gens(11, 22, 33)
    alone_g = gens(22)
    for _ in range(5):
        batched = sample_columns(logits, SamplingTensors.build(params, V, torch.device("cpu")), batch_g)
        alone = sample_columns(logits[1:2], SamplingTensors.build(params[1:2], V, torch.device("cpu")), alone_g)
        assert torch.equal(batched[1], alone[0])
    assert batch_g[1].get_state().equal(alone_g[0].get_state())
    again = sample_columns(logits[1:2], SamplingTensors.build(params[1:2], V, torch.device("cpu")), gens(22))
    first = sample_columns(logits[1:2], SamplingTensors.build(params[1:2], V, torch.device("cpu")), gens(22))
    assert torch.equal(again, first)
    other = sample_columns(logits[1:2], SamplingTensors.build(params[1:2], V, torch.device("cpu")), gens(23))
    assert not torch.equal(other, first)


def test_noise_is_never_zero():
    noise = draw_noise(gens(0, 1), 8, V, torch.device("cpu"))
    assert noise.shape == (2, 2, 8, V) and noise.min() > 0
