"""Batched per-codebook sampling of audio columns, seeded per stream.

Per row (one stream) and per codebook, over all 1026 ids (BOS/EOS included), in the order of
transformers 4.46 that REF uses: temperature -> top-k -> top-p, then a categorical draw; greedy
rows (temperature 0) take the argmax of the raw logits (no warpers, as in HF greedy search).

Besides the sampled token, every row also gets an RAS candidate: a draw from softmax(raw logits)
(no temperature/top-k/top-p). RAS itself (whether to use the candidate) is the family's per-stream
rule (Higgs v2: `models/higgs_v2/policy.py`), so the draw is made for every row and every step.

Randomness. Each stream owns a `torch.Generator` seeded from its request (or from a fresh random
seed). Per audio step a stream draws exactly 2 * K * V exponential variates from its own generator
and nothing else, and a categorical draw is the exponential race argmax(p / E) (same distribution
as torch.multinomial). Hence a stream's codes depend only on its logits and its seed: the same
request + seed gives the same codes whatever else shares the batch. They are not bit-equal to REF's
`torch.multinomial(..., generator)` stream for the same seed (REF itself draws batch-1 only).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from higgs_stream.engine.request import SamplingParams
from higgs_stream.kernels.sample_rows import warp_scores_ref

_TINY = torch.finfo(torch.float32).tiny  # exponential_ may return 0.0; 0 would always win the race


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, built on the host and moved once."""

    temperature: torch.Tensor  # [S] float32, 1.0 on greedy rows (unused there)
    top_k: torch.Tensor  # [S] long, V when off
    top_p_cut: torch.Tensor  # [S] float32: remove sorted tokens with cumulative prob <= cut (-1 when off)
    greedy: torch.Tensor  # [S] bool
    use_top_k: bool  # host flags: skip a warper no row uses
    use_top_p: bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> SamplingTensors:
        # The cut 1 - top_p is computed in double and rounded once to float32, as HF's
        # `cumulative_probs <= (1 - top_p)` does with a Python float.
        def t(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device)

        return cls(
            temperature=t([1.0 if p.greedy else p.temperature for p in params], torch.float32),
            top_k=t([min(p.top_k, vocab) if p.top_k else vocab for p in params], torch.long),
            top_p_cut=t([1.0 - p.top_p if p.top_p < 1.0 else -1.0 for p in params], torch.float32),
            greedy=t([p.greedy for p in params], torch.bool),
            use_top_k=any(p.top_k is not None and p.top_k < vocab for p in params),
            use_top_p=any(p.top_p < 1.0 for p in params),
        )


def warp_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[S, K, V] raw logits -> [S, K, V] scores after temperature, top-k, top-p (HF semantics)."""
    return warp_scores_ref(logits, st.temperature, st.top_k, st.top_p_cut, st.use_top_k, st.use_top_p)


def draw_noise(generators: Sequence[torch.Generator], k: int, v: int, device: torch.device) -> torch.Tensor:
    """[S, 2, K, V] exponential variates; row s comes from generators[s] alone."""
    noise = torch.empty((len(generators), 2, k, v), dtype=torch.float32, device=device)
    for row, gen in zip(noise, generators):
        row.exponential_(generator=gen)
    return noise.clamp_min_(_TINY)


def sample_columns(
    logits: torch.Tensor, st: SamplingTensors, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """[S, K, V] float32 audio logits -> [S, 2, K] long: (sampled token, RAS candidate) per codebook."""
    s, k, v = logits.shape
    assert len(generators) == s, f"{len(generators)} generators for {s} rows"
    noise = draw_noise(generators, k, v, logits.device)  # [S, 2, K, V]
    probs = warp_logits(logits, st).softmax(dim=-1)  # [S, K, V]
    sampled = (probs / noise[:, 0]).argmax(dim=-1)  # [S, K]
    greedy = logits.argmax(dim=-1)  # [S, K]
    token = torch.where(st.greedy[:, None], greedy, sampled)
    ras = (logits.softmax(dim=-1) / noise[:, 1]).argmax(dim=-1)  # [S, K]
    return torch.stack([token, ras], dim=1)


def resolve_seed(params: SamplingParams) -> SamplingParams:
    """Fill in a fresh random seed when the request has none (so every stream is replayable)."""
    return params if params.seed is not None else replace(params, seed=secrets.randbits(63))


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen
