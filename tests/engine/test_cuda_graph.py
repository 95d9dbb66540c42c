"""PrefillGraphs' padded all-text prefill body, run eagerly on the CPU with the plain-torch kernels
(fp32): the same K/V and last-row logits as FastTalker's unpadded forward with paged attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.cuda_graph import ChunkAttention, FirstChunk, GraphShapeError, PrefillGraphs
from higgs_stream.engine.engine import Engine
from higgs_stream.engine.fast_talker import FastInputs, FastTalker
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.kernels.flashinfer_attention import RefAttention


def _pools(cfg, lengths, num_pages=64):
    """Two caches with the scratch page first (as in the ModelRunner), then one sequence per length (ids 0..)."""
    caches = [KVCache.create(cfg, num_pages=num_pages, page_size=4) for _ in range(2)]
    for c in caches:
        c.allocator.reserve(-1, 1)
        for sid, n in enumerate(lengths):
            c.allocator.reserve(sid, n)
    return caches


@pytest.mark.parametrize("n", [1, 7, 32, 45])
def test_padded_text_prefill_equals_the_eager_forward(tiny_ckpt, n):
    base = Engine.from_pretrained(str(tiny_ckpt))
    cfg = base.cfg
    fast = FastTalker(base.talker, "ref")
    ids = np.random.default_rng(n).integers(0, 500, size=n)
    caches = _pools(cfg, [n], num_pages=16)
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
        got, _ = pg.run_many([FirstChunk(ids, slots.tolist())])
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


@pytest.mark.parametrize("arch", ["qwen3-tts", "v3"])
def test_prompt_end_sampling_padded_to_a_bucket_equals_the_unpadded(arch):
    """PromptEndGraphs' padded body (eager, CPU, fp32): 4 prompt ends in bucket 4 give the same rows and
    device state as state.sample_and_advance on the same 4 rows (same shapes: exact); 3 ends in bucket 4
    give rows of the right shape and touch no slot but theirs and the scratch ones; 10 ends run as
    8 + 2. Qwen3-TTS completes rows with its code predictor; v3 samples every codebook in the head."""
    from higgs_stream.engine.engine import EngineConfig
    from higgs_stream.engine.gpu_sampling import DeviceStreamState, StreamStart
    from higgs_stream.engine.models.registry import family_named
    from higgs_stream.engine.random_weights import in_memory_engine
    from higgs_stream.engine.request import SamplingParams
    from higgs_stream.engine.cuda_graph import PromptEndGraphs

    eng = in_memory_engine(arch, "tiny", "cpu", torch.float32, EngineConfig(kv_pages=64, max_batch=12),
                           cuda_graphs=False, kernels="ref")
    cfg, fast, completes = eng.cfg, eng.runner.fast, eng.runner.state.complete

    def state(n_slots=12):
        st = DeviceStreamState(n_slots, 8, cfg.num_codebooks, cfg.codebook_size, "cpu",
                               rules=family_named(arch).device_rules(cfg), vocab=cfg.audio_vocab, complete=completes)
        st.start([StreamStart(i, SamplingParams(seed=100 + i, temperature=0.9, top_k=40), 50,
                              np.zeros((cfg.num_codebooks, 0), np.int64)) for i in range(n_slots)])
        return st

    def snapshot(st):
        return {k: v.clone() for k, v in vars(st).items() if isinstance(v, torch.Tensor)}

    torch.manual_seed(0)
    with torch.no_grad():
        hidden = torch.randn(10, cfg.hidden_size)
        logits = fast.audio_logits(hidden)  # [10, h, V]
        a, b = state(), state()
        want = a.sample_and_advance(logits[:4], torch.arange(4), torch.ones(4, dtype=torch.bool),
                                    hidden[:4] if completes else None)
        ends = PromptEndGraphs(b, cfg.hidden_size, tuple(logits.shape[1:]), torch.float32, enabled=False)
        got = ends.run(logits[:4], hidden[:4] if completes else None, [0, 1, 2, 3])
        assert torch.equal(got, want) and got.shape == (4, cfg.num_codebooks + 1)
        sa, sb = snapshot(a), snapshot(b)
        for k in sa:
            assert torch.equal(sa[k][: a.num_slots], sb[k][: b.num_slots]), k

        c = state()
        before = snapshot(c)
        got3 = PromptEndGraphs(c, cfg.hidden_size, tuple(logits.shape[1:]), torch.float32, enabled=False).run(
            logits[4:7], hidden[4:7] if completes else None, [5, 6, 7])
        assert got3.shape == (3, cfg.num_codebooks + 1)
        after = snapshot(c)
        untouched = [i for i in range(c.num_slots) if i not in (5, 6, 7)]
        for k in before:
            if before[k].shape[:1] == (c.last_col.shape[0],):
                assert torch.equal(before[k][untouched], after[k][untouched]), k
        assert not torch.equal(before["ncols"][5:8], after["ncols"][5:8])  # the real rows advanced

        d = state()
        got10 = PromptEndGraphs(d, cfg.hidden_size, tuple(logits.shape[1:]), torch.float32, enabled=False).run(
            logits, hidden if completes else None, list(range(10)))
        assert got10.shape == (10, cfg.num_codebooks + 1)
        e = state()
        first8 = e.sample_and_advance(logits[:8], torch.arange(8), torch.ones(8, dtype=torch.bool),
                                      hidden[:8] if completes else None)
        assert torch.equal(got10[:8], first8)  # 8 rows = bucket 8: the same shapes


@pytest.mark.parametrize("n", [3, 20, 32])
def test_padded_qwen_prefill_with_every_track_equals_the_eager_forward(n):
    """A family that embeds its own rows (Qwen3-TTS): PrefillGraphs' padded body (eager, CPU, fp32) with
    text ids (some empty), codec ids (some empty), reference frames at some rows and an input vector
    gives the last row's logits and hidden state and every real row's K/V of the unpadded eager chunk,
    within 1e-5."""
    from higgs_stream.engine.engine import EngineConfig
    from higgs_stream.engine.random_weights import in_memory_engine

    eng = in_memory_engine("qwen3-tts", "tiny", "cpu", torch.float32, EngineConfig(kv_pages=64, max_batch=2),
                           cuda_graphs=False, kernels="ref")
    cfg, fast = eng.cfg, eng.runner.fast
    rng = np.random.default_rng(n)
    ids = rng.integers(0, 100, size=n)
    ids[rng.random(n) < 0.3] = -1
    codec = rng.integers(0, cfg.vocab_size, size=n)
    codec[rng.random(n) < 0.5] = -1
    audio = rng.random(n) < 0.3
    codes = rng.integers(0, cfg.codebook_size, size=(n, cfg.num_codebooks))
    vec_rows, vecs = np.array([n // 2]), rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
    caches = _pools(cfg, [n], num_pages=16)
    scratch = caches[1].allocator.page_table(-1)[0]
    layout = caches[0].layout([0], [n])
    slots = layout.slot_mapping
    attn = RefAttention(cfg.head_dim)
    attn.plan_layout(layout)
    t = torch.from_numpy
    inp = FastInputs(text_ids=t(ids), codes=t(codes), positions=torch.arange(n), kv_slots=slots,
                     out_rows=torch.tensor([n - 1]), audio_rows=t(np.flatnonzero(audio)),
                     text_rows=t(np.flatnonzero(~audio)), select=t(audio.astype(np.int32)), codec_ids=t(codec),
                     vector_rows=t(vec_rows), vectors=t(vecs))
    with torch.no_grad():
        want_h = fast.hidden(inp, attn, caches[0].pool.k, caches[0].pool.v)
        pg = PrefillGraphs(fast, caches[1].pool.k, caches[1].pool.v, scratch, 4, buckets=(8, 32), enabled=False)
        assert pg.embeds and pg.fits(n, int(audio.sum()), 1) and not pg.fits(n, 0, pg.MAX_VECTORS + 1)
        got_logits, got_h = pg.run_many([FirstChunk(ids, slots.tolist(), codes, audio, codec, vec_rows, vecs)])
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_logits, fast.audio_logits(want_h), rtol=1e-5, atol=1e-5)
    real = slots.long()
    for pool in ("k", "v"):
        a, b = (getattr(c.pool, pool).flatten(1, 2)[:, real] for c in caches)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("arch", ["v2", "qwen3-tts"])
def test_packed_first_chunks_equal_each_prompt_alone(arch):
    """Three first chunks (5, 17 and 9 rows) packed into one run of PrefillGraphs(max_prompts=4) (eager,
    CPU, fp32): each prompt's last-row logits and hidden state, and every real row's K/V, equal the
    same prompt prefilled alone (max_prompts=1) within 1e-5; Qwen3-TTS with codec ids, frames and an
    input vector per prompt (vector rows offset into the pack)."""
    from higgs_stream.engine.engine import EngineConfig
    from higgs_stream.engine.random_weights import in_memory_engine

    eng = in_memory_engine(arch, "tiny", "cpu", torch.float32, EngineConfig(kv_pages=64, max_batch=2),
                           cuda_graphs=False, kernels="ref")
    cfg, fast = eng.cfg, eng.runner.fast
    lengths = [5, 17, 9]
    rng = np.random.default_rng(7)
    caches = _pools(cfg, lengths)
    chunks = []
    for sid, n in enumerate(lengths):
        slots = caches[0].layout([sid], [n]).slot_mapping.tolist()
        ids = rng.integers(0, 100, size=n)
        if arch == "qwen3-tts":
            codec = rng.integers(0, cfg.vocab_size, size=n)
            codec[rng.random(n) < 0.5] = -1
            audio = rng.random(n) < 0.3
            codes = rng.integers(0, cfg.codebook_size, size=(n, cfg.num_codebooks))
            vec = rng.standard_normal((1, cfg.hidden_size)).astype(np.float32)
            chunks.append(FirstChunk(ids, slots, codes, audio, codec, np.array([n // 2]), vec))
        else:
            chunks.append(FirstChunk(ids, slots))
    with torch.no_grad():
        scratch = caches[0].allocator.page_table(-1)[0]
        alone = PrefillGraphs(fast, caches[0].pool.k, caches[0].pool.v, scratch, 4, buckets=(8, 32), enabled=False)
        want = [tuple(t.clone() for t in alone.run_many([c])) for c in chunks]
        packed = PrefillGraphs(fast, caches[1].pool.k, caches[1].pool.v, scratch, 4, buckets=(8, 32), enabled=False,
                               max_prompts=4)
        assert packed.packs(chunks) == [[0, 1, 2]]
        logits, hidden = packed.run_many(chunks)
    assert logits.shape[0] == hidden.shape[0] == 3
    for j, (wl, wh) in enumerate(want):
        torch.testing.assert_close(logits[j:j + 1], wl, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden[j:j + 1], wh, rtol=1e-5, atol=1e-5)
    real = torch.tensor([s for c in chunks for s in c.kv_slots])
    for pool in ("k", "v"):
        a, b = (getattr(c.pool, pool).flatten(1, 2)[:, real] for c in caches)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_packs_respect_rows_prompts_and_vectors(tiny_ckpt):

    base = Engine.from_pretrained(str(tiny_ckpt))
    fast = FastTalker(base.talker, "ref")
    cache = KVCache.create(base.cfg, num_pages=16, page_size=4)
    pg = PrefillGraphs(fast, cache.pool.k, cache.pool.v, 0, 4, buckets=(8, 32), enabled=False, max_prompts=3)
    rows = [10, 10, 10, 10, 30, 2, 1, 1]
    chunks = [FirstChunk(np.zeros(n, np.int64), list(range(n))) for n in rows]
    # 3 prompts at most; 32 rows at most (10 + 10 + 10, then 10 + 30 > 32); order kept
    assert pg.packs(chunks) == [[0, 1, 2], [3], [4, 5], [6, 7]]
    vec = lambda k: FirstChunk(np.zeros(4, np.int64), list(range(4)), vector_rows=np.zeros(k, np.int64),  # noqa: E731
                               vectors=np.zeros((k, 1), np.float32))
    assert pg.packs([vec(10), vec(6), vec(1)]) == [[0, 1], [2]]  # 17 vectors > MAX_VECTORS (16)
    with pytest.raises(AssertionError):
        PrefillGraphs(fast, cache.pool.k, cache.pool.v, 0, 4, buckets=(8, 32), enabled=False, max_prompts=9)


def test_chunk_attention_with_prompts_packed_is_block_diagonal():
    torch.manual_seed(1)
    hq, hkv, d = 4, 2, 8
    seg = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])  # rows 5..7: padding (a prompt of their own)
    n = len(seg)
    pool_k, pool_v = torch.randn(4, 4, hkv, d), torch.randn(4, 4, hkv, d)
    slots = torch.randperm(16)[:n]
    q = torch.randn(n, hq, d)
    got = ChunkAttention(slots, hq, hkv, d, seg).run(q, pool_k, pool_v)
    for lo, hi in ((0, 3), (3, 5), (5, 8)):  # each prompt alone: plain causal attention
        want = ChunkAttention(slots[lo:hi], hq, hkv, d).run(q[lo:hi], pool_k, pool_v)
        torch.testing.assert_close(got[lo:hi], want, rtol=1e-5, atol=1e-5)


def test_decode_kernel_per_bucket():
    """Which attention kernel a decode graph of n rows runs: Triton from its threshold (over any pages), else
    FlashInfer's tensor cores from theirs (16-bit pages only: over fp8 they were slower), else its CUDA cores."""
    from higgs_stream.kernels.flashinfer_attention import decode_kernel
    assert [decode_kernel(n, 2, None, None) for n in (1, 256)] == ["cuda_cores"] * 2
    assert [decode_kernel(n, 2, 128, None) for n in (64, 128, 256)] == ["cuda_cores", "tensor_cores", "tensor_cores"]
    assert decode_kernel(256, 1, 128, None) == "cuda_cores"  # fp8 pages: no tensor-core decode
    assert [decode_kernel(n, 1, 64, 192) for n in (16, 128, 192)] == ["cuda_cores", "cuda_cores", "triton"]
    assert [decode_kernel(n, 2, 64, 192) for n in (16, 128, 192)] == ["cuda_cores", "tensor_cores", "triton"]
    ranged = [decode_kernel(n, kv, 128, 64, ranged_below=True) for n in (1, 32, 64, 256) for kv in (1, 2)]
    assert ranged == ["triton_ranges"] * 4 + ["triton"] * 4  # below triton_from, over either page type
    assert decode_kernel(1, 2, None, None, ranged_below=True) == "cuda_cores"  # no Triton decode at all
