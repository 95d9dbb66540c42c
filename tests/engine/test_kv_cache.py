import random

import pytest
import torch

from higgs_stream.engine.errors import CapacityError, ConfigError, NotFoundError
from higgs_stream.engine.kv_cache import KVCache, KVPool, PageAllocator
from higgs_stream.engine.models.higgs_v2.config import TalkerConfig
from higgs_stream.kernels.attention import write_paged_kv_ref


def test_reserve_grows_by_whole_pages():
    alloc = PageAllocator(num_pages=8, page_size=4)
    alloc.reserve(1, 5)
    assert len(alloc.page_table(1)) == 2 and alloc.seq_len(1) == 5
    alloc.reserve(1, 8)
    assert len(alloc.page_table(1)) == 2 and alloc.seq_len(1) == 8
    alloc.reserve(1, 9)
    assert len(alloc.page_table(1)) == 3 and alloc.seq_len(1) == 9
    assert alloc.num_used == 3 and alloc.num_free == 5 and alloc.active_seqs == [1]
    with pytest.raises(AssertionError, match="never shrinks"):
        alloc.reserve(1, 3)


def test_exhaustion_raises_capacity_error_and_changes_nothing():
    alloc = PageAllocator(num_pages=4, page_size=4)
    alloc.reserve(1, 12)
    assert not alloc.can_reserve(2, 8) and alloc.pages_missing(2, 8) == 2
    with pytest.raises(CapacityError, match="needs 2 more pages") as info:
        alloc.reserve(2, 8)
    assert info.value.code == "busy"
    assert alloc.num_free == 1 and alloc.active_seqs == [1]
    with pytest.raises(NotFoundError):
        alloc.seq_len(2)
    with pytest.raises(CapacityError):
        alloc.reserve(1, 17)
    assert alloc.seq_len(1) == 12 and len(alloc.page_table(1)) == 3
    alloc.reserve(2, 4)  # the last page still fits
    assert alloc.num_free == 0


def test_free_returns_every_page():
    alloc = PageAllocator(num_pages=6, page_size=2)
    alloc.reserve(1, 3)
    alloc.reserve(2, 5)
    assert set(alloc.page_table(1)).isdisjoint(alloc.page_table(2))
    alloc.free(1)
    assert alloc.num_free == 3 and alloc.active_seqs == [2]
    alloc.reserve(3, 6)  # reuses seq 1's pages
    assert alloc.num_free == 0
    alloc.free(2)
    alloc.free(3)
    assert alloc.num_used == 0 and alloc.num_free == 6 and alloc.active_seqs == []
    with pytest.raises(NotFoundError):
        alloc.free(3)
    with pytest.raises(NotFoundError):
        alloc.page_table(1)


def test_random_churn_keeps_pages_partitioned():
    rng = random.Random(0)
    alloc = PageAllocator(num_pages=32, page_size=3)
    lens: dict[int, int] = {}
    for step in range(500):
        sid = rng.randrange(8)
        if sid in lens and rng.random() < 0.3:
            alloc.free(sid)
            del lens[sid]
            continue
        new_len = lens.get(sid, 0) + rng.randrange(1, 10)
        if alloc.can_reserve(sid, new_len):
            alloc.reserve(sid, new_len)
            lens[sid] = new_len
        else:
            with pytest.raises(CapacityError):
                alloc.reserve(sid, new_len)
        owned = [p for s in alloc.active_seqs for p in alloc.page_table(s)]
        assert len(owned) == len(set(owned)) == alloc.num_used
        assert all(len(alloc.page_table(s)) == -(-lens[s] // 3) for s in lens)
    for sid in list(lens):
        alloc.free(sid)
    assert alloc.num_free == 32


def test_pool_shapes_and_bytes():
    cfg = TalkerConfig.tiny(num_layers=3, num_kv_heads=2, head_dim=16)
    cache = KVCache.create(cfg, num_pages=10, page_size=4, dtype=torch.bfloat16)
    assert cache.pool.k.shape == (3, 10, 4, 2, 16) and cache.pool.v.dtype == torch.bfloat16
    assert cache.pool.nbytes == KVCache.bytes_per_page(cfg, 4, torch.bfloat16) * 10
    # the released 3B talker: 28 layers x K,V x 8 heads x 128 x 2 bytes = 112 KiB per token
    assert KVCache.bytes_per_page(TalkerConfig.full(), 1, torch.bfloat16) == 114688
    with pytest.raises(AssertionError):
        KVCache(KVPool(1, 4, 4, 1, 8), PageAllocator(5, 4))


def test_a_pool_larger_than_the_machine_is_a_config_error(monkeypatch):
    """Checked against the RAM before allocating (Linux would overcommit zeros of that size and fail later); an
    allocation that fails anyway (CUDA out of memory, the CPU allocator) is the same error."""
    import higgs_stream.engine.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "physical_memory_bytes", lambda: 2 * 4 * 16 * 2 * 8 * 4 - 1)
    with pytest.raises(ConfigError, match=r"the KV cache \(4 pages: 0.0 GiB\) does not fit on cpu"):
        KVPool(num_layers=2, num_pages=4, page_size=16, num_kv_heads=2, head_dim=8)
    monkeypatch.setattr(kv_cache, "physical_memory_bytes", lambda: 2**63)

    def fail(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes")

    monkeypatch.setattr(kv_cache.torch, "zeros", fail)
    with pytest.raises(ConfigError, match="does not fit on cpu; use fewer pages .* can't allocate memory"):
        KVPool(num_layers=2, num_pages=4, page_size=16, num_kv_heads=2, head_dim=8)


def test_layout_slots_follow_page_tables():
    cfg = TalkerConfig.tiny(num_layers=1, num_kv_heads=1, head_dim=2)
    cache = KVCache.create(cfg, num_pages=8, page_size=2)
    cache.allocator.reserve(0, 1)
    cache.allocator.reserve(1, 3)
    cache.allocator.reserve(0, 5)  # seq 0's pages interleave with seq 1's
    layout = cache.layout([0, 1], [5, 3])
    k = torch.arange(8, dtype=torch.float32)[:, None, None].expand(8, 1, 2)  # token t of the step -> value t
    write_paged_kv_ref(cache.pool.k[0], cache.pool.v[0], k, k, layout.slot_mapping)
    for seq, lo in ((0, 0), (1, 5)):
        table = cache.allocator.page_table(seq)
        stored = cache.pool.k[0][table].reshape(-1, 2)[: cache.allocator.seq_len(seq), 0]
        assert stored.tolist() == list(range(lo, lo + cache.allocator.seq_len(seq)))
