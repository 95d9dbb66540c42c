import pytest
import torch
import torch.nn.functional as F

from higgs_stream.kernels.attention import PagedLayout, paged_attention_ref, write_paged_kv_ref


def test_layout_csr_form_by_hand():
    # seq 0: 6 tokens in pages [5, 2] (page_size 4), 2 new; seq 1: 1 token in page [7] (+ a spare), 1 new
    layout = PagedLayout.build([[5, 2], [7, 0]], kv_lens=[6, 1], qo_lens=[2, 1], page_size=4)
    assert layout.qo_indptr.tolist() == [0, 2, 3]
    assert layout.kv_indptr.tolist() == [0, 2, 3]
    assert layout.kv_indices.tolist() == [5, 2, 7]
    assert layout.kv_last_page_len.tolist() == [2, 1]
    assert layout.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 7 * 4 + 0]
    assert layout.last_token_index.tolist() == [1, 2]
    with pytest.raises(AssertionError, match="pages"):
        PagedLayout.build([[5]], kv_lens=[6], qo_lens=[1], page_size=4)
    with pytest.raises(AssertionError, match="qo_len"):
        PagedLayout.build([[5, 2]], kv_lens=[6], qo_lens=[7], page_size=4)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_paged_matches_dense_causal_attention(num_kv_heads):
    """Scatter each sequence's K/V into shuffled pages, then compare with dense causal SDPA."""
    gen = torch.Generator().manual_seed(num_kv_heads)
    page_size, num_pages, hq, d = 4, 40, 4, 8
    kv_lens, qo_lens = [13, 1, 8, 20, 5], [13, 1, 3, 1, 2]  # full prefill, decode, chunks
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, used = [], 0
    for kv in kv_lens:
        n = -(-kv // page_size)
        tables.append(perm[used : used + n])
        used += n
    layout = PagedLayout.build(tables, kv_lens, qo_lens, page_size)
    k_pool = torch.randn(num_pages, page_size, num_kv_heads, d, generator=gen, dtype=torch.float64)
    v_pool = torch.randn_like(k_pool)
    dense_k, dense_v = [], []
    for table, kv in zip(tables, kv_lens):  # write the whole history through the slot path
        k = torch.randn(kv, num_kv_heads, d, generator=gen, dtype=torch.float64)
        v = torch.randn(kv, num_kv_heads, d, generator=gen, dtype=torch.float64)
        full = PagedLayout.build([table], [kv], [kv], page_size)
        write_paged_kv_ref(k_pool, v_pool, k, v, full.slot_mapping)
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen, dtype=torch.float64)
    got = paged_attention_ref(q, k_pool, v_pool, layout, sm_scale=d**-0.5)

    start = 0
    for k, v, kv, qo in zip(dense_k, dense_v, kv_lens, qo_lens):
        qb = q[start : start + qo].transpose(0, 1)  # [Hq, qo, D]
        kb = k.repeat_interleave(hq // num_kv_heads, dim=1).transpose(0, 1)  # [Hq, kv, D]
        vb = v.repeat_interleave(hq // num_kv_heads, dim=1).transpose(0, 1)
        allowed = torch.ones(qo, kv, dtype=torch.bool).tril(diagonal=kv - qo)  # bottom-right causal
        expect = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed).transpose(0, 1)
        torch.testing.assert_close(got[start : start + qo], expect, rtol=1e-10, atol=1e-10)
        start += qo


def test_fp32_inputs_keep_dtype_and_ignore_foreign_pages():
    gen = torch.Generator().manual_seed(3)
    k_pool = torch.randn(6, 2, 1, 4, generator=gen)
    v_pool = torch.randn_like(k_pool)
    layout = PagedLayout.build([[4, 1]], kv_lens=[3], qo_lens=[1], page_size=2)
    q = torch.randn(1, 2, 4, generator=gen)
    out = paged_attention_ref(q, k_pool, v_pool, layout, sm_scale=0.5)
    k_pool[[0, 2, 3, 5]] = 1e4  # pages this sequence does not own, and the unused slot of page 1
    k_pool[1, 1] = 1e4
    assert out.dtype == torch.float32
    assert torch.equal(paged_attention_ref(q, k_pool, v_pool, layout, sm_scale=0.5), out)
