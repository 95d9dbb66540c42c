"""The code predictor's frame attention (fast_predictor.FrameAttention): SDPA with shared K/V heads
(`enable_gqa`) equals attention over K/V copied out per query head, for the first sub-step (2 causal
rows) and a later one (1 row over the filled prefix). GPU twin (bf16, the flash kernel):
test_fast_predictor_gpu.py."""

from __future__ import annotations

import pytest
import torch

from higgs_stream.engine.models.qwen3_tts.fast_predictor import FrameAttention


@pytest.mark.parametrize("t,s", [(2, 2), (1, 9), (1, 16)])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)])
def test_shared_heads_equal_copied_heads(t, s, hq, hkv, copied_heads):
    g = torch.Generator().manual_seed(t * 100 + s)
    b, d = 3, 16
    q = torch.randn(b * t, hq, d, generator=g)
    k_cache, v_cache = (torch.randn(b, 16, hkv, d, generator=g) for _ in range(2))
    got = FrameAttention(t, s, hq, hkv, d).run(q, k_cache, v_cache)
    want = copied_heads(q, k_cache, v_cache, t, s, hq, hkv, d)
    assert got.shape == (b * t, hq, d)
    assert (got - want).abs().max().item() <= 1e-5  # fp32 rounding of O(1) values
