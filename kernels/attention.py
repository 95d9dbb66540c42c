"""Paged causal attention over a ragged batch (plain-torch reference, CPU-runnable).

A ragged step holds B sequences; sequence b contributes qo_lens[b] new query tokens (a prefill
chunk, or 1 for a decode step) that are the LAST qo_lens[b] of its kv_lens[b] cached tokens.
Query j of sequence b sees keys 0 .. kv_lens[b] - qo_lens[b] + j (bottom-right aligned causal
mask, as FlashInfer's paged prefill with causal=True).

K/V live in a page pool per layer, [P, page_size, Hkv, D] (FlashInfer's NHD layout); sequence b
owns the pages listed in its page table. `PagedLayout` carries the same information in
FlashInfer's CSR form (qo_indptr, kv_indptr, kv_indices, kv_last_page_len) so a FlashInfer
backend can be planned from it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedLayout:
    """Where every sequence of one ragged step lives: host lists plus the device tensors."""

    page_size: int
    qo_lens: list[int]
    kv_lens: list[int]
    page_tables: list[list[int]]  # pages actually holding the kv_lens[b] tokens
    qo_indptr: torch.Tensor  # [B+1] int32, query token offsets
    kv_indptr: torch.Tensor  # [B+1] int32, offsets into kv_indices
    kv_indices: torch.Tensor  # [sum pages] int32, concatenated page tables
    kv_last_page_len: torch.Tensor  # [B] int32, tokens in each sequence's last page (1..page_size)
    slot_mapping: torch.Tensor  # [N] long, pool slot (page * page_size + offset) of each new token
    last_token_index: torch.Tensor  # [B] long, row of each sequence's last new token in [N]

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.qo_lens)

    @classmethod
    def build(
        cls,
        page_tables: Sequence[Sequence[int]],
        kv_lens: Sequence[int],
        qo_lens: Sequence[int],
        page_size: int,
        device: torch.device | str = "cpu",
    ) -> PagedLayout:
        """From per-sequence page tables (may hold spare pages beyond kv_len) and lengths."""
        assert len(page_tables) == len(kv_lens) == len(qo_lens), "one page table, kv_len and qo_len per sequence"
        assert page_size > 0, f"page_size must be positive, got {page_size}"
        tables: list[list[int]] = []
        slots: list[int] = []
        last_page_len: list[int] = []
        for table, kv_len, qo_len in zip(page_tables, kv_lens, qo_lens):
            assert 1 <= qo_len <= kv_len, f"need 1 <= qo_len ({qo_len}) <= kv_len ({kv_len})"
            num_pages = -(-kv_len // page_size)
            assert len(table) >= num_pages, f"{kv_len} tokens need {num_pages} pages, table has {len(table)}"
            used = [int(p) for p in table[:num_pages]]
            tables.append(used)
            last_page_len.append(kv_len - (num_pages - 1) * page_size)
            for pos in range(kv_len - qo_len, kv_len):
                slots.append(used[pos // page_size] * page_size + pos % page_size)
        qo_indptr = [0]
        kv_indptr = [0]
        for qo_len, used in zip(qo_lens, tables):
            qo_indptr.append(qo_indptr[-1] + int(qo_len))
            kv_indptr.append(kv_indptr[-1] + len(used))

        def ints(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        return cls(
            page_size=page_size,
            qo_lens=[int(x) for x in qo_lens],
            kv_lens=[int(x) for x in kv_lens],
            page_tables=tables,
            qo_indptr=ints(qo_indptr, torch.int32),
            kv_indptr=ints(kv_indptr, torch.int32),
            kv_indices=ints([p for used in tables for p in used], torch.int32),
            kv_last_page_len=ints(last_page_len, torch.int32),
            slot_mapping=ints(slots, torch.long),
            last_token_index=ints([end - 1 for end in qo_indptr[1:]], torch.long),
        )


FP8_KV = torch.float8_e4m3fn  # the fp8 K/V pool dtype (`EngineConfig.kv_cache_dtype="fp8"`)
FP8_KV_MAX = 448.0


def to_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values as a pool of `dtype` stores them: an fp8 pool saturates at +-448 (unscaled: K and V
    are O(1)..O(10) in these models) where a plain cast would give NaN."""
    if dtype == FP8_KV:
        return x.float().clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)
    return x.to(dtype)


def store_rows(flat: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """flat[slots] = to_kv(values): an fp8 pool through its byte view (the CPU's index_copy_ has no fp8)."""
    v = to_kv(values, flat.dtype)
    if flat.dtype == FP8_KV:
        flat.view(torch.uint8).index_copy_(0, slots, v.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, v)


def write_paged_kv_ref(
    k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values: pools [P, page_size, Hkv, D], k/v [N, Hkv, D], slot_mapping [N]."""
    assert k.shape == v.shape and k.shape[1:] == k_pool.shape[2:], f"kv {k.shape} vs pool {k_pool.shape}"
    assert slot_mapping.shape == (k.shape[0],), f"slot_mapping {slot_mapping.shape} for {k.shape[0]} tokens"
    k_flat = k_pool.view(-1, *k_pool.shape[2:])  # [P * page_size, Hkv, D]
    v_flat = v_pool.view(-1, *v_pool.shape[2:])
    store_rows(k_flat, slot_mapping, k)
    store_rows(v_flat, slot_mapping, v)


def paged_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    layout: PagedLayout,
    sm_scale: float,
) -> torch.Tensor:
    """q [N, Hq, D], pools [P, page_size, Hkv, D] -> [N, Hq, D] (scores and softmax in >= fp32)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[2]
    assert num_tokens == layout.num_tokens, f"q has {num_tokens} rows, layout {layout.num_tokens}"
    assert num_q_heads % num_kv_heads == 0, f"{num_q_heads} query heads over {num_kv_heads} kv heads"
    assert k_pool.shape[1] == layout.page_size, "pool page size differs from the layout's"
    group = num_q_heads // num_kv_heads
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    start = 0
    for table, kv_len, qo_len in zip(layout.page_tables, layout.kv_lens, layout.qo_lens):
        pages = torch.tensor(table, dtype=torch.long, device=q.device)
        k = k_pool[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len]  # [kv, Hkv, D]
        v = v_pool[pages].reshape(-1, num_kv_heads, head_dim)[:kv_len]
        k = k.to(acc).repeat_interleave(group, dim=1)  # [kv, Hq, D]; q head h reads kv head h // group
        v = v.to(acc).repeat_interleave(group, dim=1)
        qb = q[start : start + qo_len].to(acc)  # [qo, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale  # [Hq, qo, kv]
        query_pos = torch.arange(kv_len - qo_len, kv_len, device=q.device)[:, None]  # [qo, 1]
        key_pos = torch.arange(kv_len, device=q.device)[None, :]  # [1, kv]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + qo_len] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start += qo_len
    return out
