"""Triton RoPE + paged K/V store == the plain-torch reference, and both == kernels.rope (CUDA only)."""

import pytest
import torch

from higgs_stream.kernels.rope import apply_rope_ref, llama3_inv_freq, rope_cos_sin
from higgs_stream.kernels.rope_kv import cos_sin_table, rope_store_kv, rope_store_kv_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("n", [1, 19, 300])
def test_matches_ref_and_rope(n):
    hq, hkv, d, pages, ps = 24, 8, 128, 64, 16
    inv = llama3_inv_freq(d, 500000.0, SCALING)
    table = cos_sin_table(inv, 9000, "cuda")
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device="cuda").bfloat16()
    positions = torch.randint(0, 9000, (n,), device="cuda")
    slots = torch.randperm(pages * ps, device="cuda")[:n]
    pools = [torch.randn(pages, ps, hkv, d, device="cuda").bfloat16() for _ in range(2)]
    ref_pools = [p.clone() for p in pools]
    want = rope_store_kv_ref(qkv, positions, table, slots, *ref_pools, hq, hkv, d)
    got = rope_store_kv(qkv, positions, table, slots, *pools, hq, hkv, d)
    for a, b in [(got, want), (pools[0], ref_pools[0]), (pools[1], ref_pools[1])]:
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 4e-3, err
    assert torch.equal(pools[1], ref_pools[1])  # V is copied, not rotated
    # the same angles as the talker's reference RoPE (fp32 throughout)
    cos, sin = rope_cos_sin(positions, inv.cuda(), torch.float32)
    q32 = qkv.float().view(n, -1, d)[:, :hq]
    err = ((apply_rope_ref(q32, cos, sin) - got.float()).norm() / got.float().norm()).item()
    assert err < 4e-3, err


@pytest.mark.parametrize("n", [1, 37])
def test_qk_norm_fused_matches_ref_and_the_unfused_norm(n):
    """Qwen3 layers (v3, Qwen3-TTS: 16 q / 8 kv heads of 128): the fused QK-norm == the reference (bf16
    rounding of the normed heads may differ by one unit where the fp32 sums differ), and == the unfused
    path (add_rms_norm of each head, written back, then RoPE) it replaced."""
    from higgs_stream.kernels.fused_norm import add_rms_norm

    hq, hkv, d, pages, ps = 16, 8, 128, 16, 16
    table = cos_sin_table(llama3_inv_freq(d, 1000000.0, None), 4096, "cuda")
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device="cuda").bfloat16() * 4
    w = (torch.rand(2, d, device="cuda") + 0.5).bfloat16()
    positions = torch.randint(0, 4096, (n,), device="cuda")
    slots = torch.randperm(pages * ps, device="cuda")[:n]
    pools = [torch.zeros(pages, ps, hkv, d, device="cuda").bfloat16() for _ in range(2)]
    ref_pools, unfused_pools = [p.clone() for p in pools], [p.clone() for p in pools]
    got = rope_store_kv(qkv, positions, table, slots, *pools, hq, hkv, d, w, 1e-6)
    want = rope_store_kv_ref(qkv, positions, table, slots, *ref_pools, hq, hkv, d, w, 1e-6)
    heads = qkv.clone().view(n, hq + 2 * hkv, d)
    select = (torch.arange(hq + hkv, device="cuda") >= hq).int().repeat(n)
    rows = heads[:, : hq + hkv].float().reshape(-1, d)
    heads[:, : hq + hkv] = add_rms_norm(None, rows, w, 1e-6, select, torch.bfloat16).view(n, hq + hkv, d)
    unfused = rope_store_kv(heads.view(n, -1), positions, table, slots, *unfused_pools, hq, hkv, d)
    for a, b in [(got, want), (pools[0], ref_pools[0]), (got, unfused), (pools[0], unfused_pools[0])]:
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 4e-3, err
    assert torch.equal(pools[1], ref_pools[1])  # V is neither normed nor rotated
    # graph replay == eager
    graph_pools = [torch.zeros_like(p) for p in pools]
    rope_store_kv(qkv, positions, table, slots, *graph_pools, hq, hkv, d, w, 1e-6)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        replayed = rope_store_kv(qkv, positions, table, slots, *graph_pools, hq, hkv, d, w, 1e-6)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, got) and torch.equal(graph_pools[0], pools[0])


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 pages need compute capability >= 8.9")
def test_fp8_pages_store_the_saturated_rounding():
    """An e4m3 pool (--kv-cache-dtype fp8): K within one e4m3 step of the reference's (its rotation
    is rounded to bf16 before the fp8 cast; the kernel casts from fp32), V equal, large values
    saturated at 448 (never NaN)."""
    hq, hkv, d, pages, ps, n = 24, 8, 128, 64, 16, 77
    table = cos_sin_table(llama3_inv_freq(d, 500000.0, SCALING), 9000, "cuda")
    qkv = (torch.randn(n, (hq + 2 * hkv) * d, device="cuda") * 150).bfloat16()  # many values past 448
    positions = torch.randint(0, 9000, (n,), device="cuda")
    slots = torch.randperm(pages * ps, device="cuda")[:n]
    pools = [torch.zeros(pages, ps, hkv, d, device="cuda", dtype=torch.float8_e4m3fn) for _ in range(2)]
    ref_pools = [p.clone() for p in pools]
    rope_store_kv_ref(qkv, positions, table, slots, *ref_pools, hq, hkv, d)
    rope_store_kv(qkv, positions, table, slots, *pools, hq, hkv, d)
    k, k_ref = pools[0].float(), ref_pools[0].float()
    assert torch.isfinite(k).all() and torch.isfinite(pools[1].float()).all() and k.abs().max() == 448
    assert ((k - k_ref).abs() <= k_ref.abs() / 8 + 2.0**-9).all()  # one e4m3 step: 2^-3 relative
    assert torch.equal(pools[1].view(torch.uint8), ref_pools[1].view(torch.uint8))
