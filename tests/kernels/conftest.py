"""Helpers of the kernel tests, shared by the CPU tests, their GPU twins and the interpreter scripts
(which import this file by path)."""

from __future__ import annotations

import pytest
import torch

from higgs_stream.kernels.sample_rows import warp_scores_ref


def params(b: int, v: int, seed: int) -> dict[str, torch.Tensor]:
    """Per-stream sampling parameters covering every case: top-k off (V), top-k 1, top-p off (cut -1),
    tight and loose top-p, temperatures around 1, greedy rows."""
    g = torch.Generator().manual_seed(seed)
    top_k = torch.randint(1, v + 1, (b,), generator=g)
    top_k[::3], top_k[1::5] = v, 1
    cut = torch.rand(b, generator=g) * 0.6
    cut[::4] = -1.0
    greedy = torch.zeros(b, dtype=torch.bool)
    greedy[2::7] = True
    temperature = torch.where(greedy, 1.0, torch.rand(b, generator=g) + 0.5)
    return {"temperature": temperature, "top_k": top_k, "top_p_cut": cut, "greedy": greedy}


def ambiguous(logits: torch.Tensor, noise: torch.Tensor, p: dict[str, torch.Tensor], tol: float = 1e-4) -> torch.Tensor:
    """[B, H] rows whose draw rounding or tie order could decide. The race's winner, argmax(score - log
    noise), does not depend on the softmax's normalisation, only on which ids top-p keeps: an id whose
    cumulative top-p mass lies within `tol` of the cut, or whose score ties one at the cut (the warper drops
    an arbitrary subset of tied ids there, the kernel keeps them all), may go either way, so a row is
    ambiguous when keeping and dropping those ids crown different winners. Also ambiguous: the two best
    race keys within a relative `tol`, and greedy rows whose two best logits tie."""
    v = logits.shape[-1]
    scores = warp_scores_ref(logits, p["temperature"], p["top_k"], p["top_p_cut"], use_top_p=False)
    asc, order = scores.sort(dim=-1)
    cum = asc.softmax(dim=-1).cumsum(dim=-1)
    cut = p["top_p_cut"][:, None, None]
    n_drop = (cum <= cut).sum(dim=-1, keepdim=True).clamp(max=v - 1)  # the warper's dropped prefix
    first_kept, last_dropped = asc.gather(-1, n_drop), asc.gather(-1, (n_drop - 1).clamp(min=0))
    straddles = (n_drop > 0) & (first_kept == last_dropped) & torch.isfinite(first_kept)  # a tie across the cut
    maybe = ((cum - cut).abs() < tol) | (straddles & (asc == first_kept))
    maybe[..., -1] = False  # the best id is always kept
    surely_dropped = (cum <= cut) & ~maybe
    surely_dropped[..., -1] = False
    key = asc - noise.gather(-1, order).log()  # the race key of each sorted id
    lo = key.masked_fill(surely_dropped | maybe, float("-inf")).argmax(dim=-1)
    hi = key.masked_fill(surely_dropped, float("-inf")).argmax(dim=-1)
    near_cut = lo != hi
    ratios = warp_scores_ref(logits, p["temperature"], p["top_k"], p["top_p_cut"]).softmax(-1) / noise
    best = ratios.topk(2, dim=-1).values
    near_tie = (best[..., 0] - best[..., 1]) < tol * best[..., 0]
    top2 = logits.topk(2, dim=-1).values
    greedy_tie = p["greedy"][:, None] & (top2[..., 0] == top2[..., 1])
    return near_cut | near_tie | greedy_tie


@pytest.fixture
def sampling_cases():
    """(params, ambiguous) above, for the tests of the fused draw."""
    return params, ambiguous
