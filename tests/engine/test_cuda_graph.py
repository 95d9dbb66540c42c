"""PrefillGraphs' padded all-text prefill body, run eagerly on the CPU with the plain-torch kernels
(fp32): the same K/V and last-row logits as FastTalker's unpadded forward with paged attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.cuda_graph import ChunkAttention, GraphShapeError, PrefillGraphs
from higgs_stream.engine.engine import Engine
from higgs_stream.engine.fast_talker import FastInputs, FastTalker
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.kernels.flashinfer_attention import RefAttention


@pytest.mark.parametrize("n", [1, 7, 32, 45])
def test_padded_text_prefill_equals_the_eager_forward(tiny_ckpt, n):
    base = Engine.from_pretrained(str(tiny_ckpt))
    cfg = base.cfg
    fast = FastTalker(base.talker, "ref")
    ids = np.random.default_rng(n).integers(0, 500, size=n)
    caches = [KVCache.create(cfg, num_pages=16, page_size=4) for _ in range(2)]
    for c in caches:
        c.allocator.reserve(-1, 1)  # scratch page first, as in the ModelRunner
        c.allocator.reserve(0, n)
    scratch = caches[1].allocator.page_table(-1)[0]
    layout = caches[0].layout([0], [n])
    slots = layout.slot_mapping  # [n]
    attn = RefAttention(cfg.head_dim)
    attn.plan_layout(layout)
    t = torch.from_numpy
    inp = FastInputs(text_ids=t(ids), codes=torch.zeros((n, 8), dtype=torch.long), positions=torch.arange(n),
                     kv_slots=slots, out_rows=torch.tensor([n - 1]), audio_rows=torch.zeros(0, dtype=torch.long),
                     text_rows=torch.arange(n), select=torch.zeros(n, dtype=torch.int32))
    with torch.no_grad():
        want = fast.forward(inp, attn, caches[0].pool.k, caches[0].pool.v)  # [1, K, V]
        pg = PrefillGraphs(fast, caches[1].pool.k, caches[1].pool.v, scratch, 4, buckets=(8, 32, 64), enabled=False)
        got = pg.run(ids, slots.tolist())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    real = slots.long()
    for pool in ("k", "v"):
        a, b = (getattr(c.pool, pool).flatten(1, 2)[:, real] for c in caches)  # [layers, n, Hkv, D]
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert pg.bucket_for(n) == min(b for b in (8, 32, 64) if b >= n)
    with pytest.raises(GraphShapeError):
        pg.bucket_for(65)


def test_chunk_attention_is_causal_gqa():
    torch.manual_seed(0)
    hq, hkv, d, n = 6, 2, 8, 5
    pool_k, pool_v = torch.randn(4, 4, hkv, d), torch.randn(4, 4, hkv, d)
    slots = torch.tensor([3, 9, 4, 12, 0])
    q = torch.randn(n, hq, d)
    got = ChunkAttention(slots, hq, hkv, d).run(q, pool_k, pool_v)
    k, v = pool_k.view(-1, hkv, d)[slots], pool_v.view(-1, hkv, d)[slots]
    for i in range(n):
        for h in range(hq):
            s = (k[: i + 1, h // 3] @ q[i, h]) * d**-0.5
            ref = torch.softmax(s, 0) @ v[: i + 1, h // 3]
            torch.testing.assert_close(got[i, h], ref, rtol=1e-5, atol=1e-5)
