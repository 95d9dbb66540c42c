"""RoPE (llama3-scaled frequencies, half-split layout) fused with the paged K/V store.

From one fused projection row `qkv` = [q heads | k heads | v heads] of each new token:

    q_out[n]            = rope(q[n], positions[n])          -> returned [N, Hq, D]
    k_cache[slots[n]]   = rope(k[n], positions[n])          (written into the page pool)
    v_cache[slots[n]]   = v[n]

With `qk_norm` (Qwen3's per-head RMSNorm of the q and k heads, weight [2, D]: row 0 for q heads,
row 1 for k heads), each q/k head is first normalized in fp32 and rounded to qkv's dtype, as an
unfused norm that wrote its result back into qkv would leave it, then rotated:

    x = (x * rsqrt(mean(x^2) + eps) * qk_norm[is_k_head]).to(qkv.dtype)

One launch instead of three (an fp32 copy of the heads, the norm, the copy back) per layer.

The rotation angles come from a precomputed table `cos_sin` [max_pos, D] fp32 whose row p holds
cos(p * inv_freq) in its first D/2 entries and sin(p * inv_freq) in the rest (`cos_sin_table`),
inv_freq from `kernels.rope.llama3_inv_freq`: the same angles as `kernels.rope.rope_cos_sin`.
The rotation is done in fp32 and cast once. K/V pools are [P, page_size, Hkv, D] (NHD), slots
index their flattened [P * page_size] token axis; an fp8 (e4m3) pool stores values saturated at
+-448 (`attention.to_kv`).

`rope_store_kv_ref` is the plain-torch definition; `rope_store_kv` the Triton kernel (CUDA only,
one program per token and head).
"""

from __future__ import annotations

import functools

import torch

from higgs_stream.kernels._triton import pdl_args, require_cuda, triton_modules
from higgs_stream.kernels.attention import FP8_KV, FP8_KV_MAX, store_rows


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int, device: torch.device | str) -> torch.Tensor:
    """[max_positions, D] fp32: cos | sin of p * inv_freq (angles in fp32, as rope_cos_sin)."""
    positions = torch.arange(max_positions, device=device).float()[:, None]  # [P, 1]
    angles = positions * inv_freq.to(device).float()[None, :]  # [P, D/2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous()


def _check(qkv, positions, cos_sin, slots, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, qk_norm=None):
    n = qkv.shape[0]
    assert qk_norm is None or qk_norm.shape == (2, head_dim), f"qk_norm must be [2, {head_dim}]"
    assert qkv.shape == (n, (num_q_heads + 2 * num_kv_heads) * head_dim), f"qkv {tuple(qkv.shape)}"
    assert positions.shape == (n,) and slots.shape == (n,), "positions/slots must be [N]"
    assert cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim and cos_sin.dtype == torch.float32, "cos_sin [P, D] fp32"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), \
        f"pools must be [P, page, {num_kv_heads}, {head_dim}], got {tuple(k_cache.shape)}"


def rope_store_kv_ref(
    qkv: torch.Tensor,  # [N, (Hq + 2 Hkv) * D]
    positions: torch.Tensor,  # [N] long
    cos_sin: torch.Tensor,  # [max_pos, D] fp32
    slots: torch.Tensor,  # [N] long, flat pool slot of each token
    k_cache: torch.Tensor,  # [P, page, Hkv, D]
    v_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: torch.Tensor | None = None,  # [2, D] (q, k) per-head RMSNorm weights, or None
    eps: float = 0.0,
) -> torch.Tensor:
    """-> q [N, Hq, D] in qkv's dtype; k/v written into the pools."""
    _check(qkv, positions, cos_sin, slots, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, qk_norm)
    n, half = qkv.shape[0], head_dim // 2
    heads = qkv.float().view(n, num_q_heads + 2 * num_kv_heads, head_dim)
    cs = cos_sin[positions]  # [N, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]  # [N, 1, D/2]
    rot = heads[:, : num_q_heads + num_kv_heads]
    if qk_norm is not None:
        w = qk_norm.float()[(torch.arange(num_q_heads + num_kv_heads, device=qkv.device) >= num_q_heads).long()]
        rot = (rot * torch.rsqrt(rot.pow(2).mean(dim=-1, keepdim=True) + eps) * w).to(qkv.dtype).float()
    x1, x2 = rot[..., :half], rot[..., half:]
    rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(qkv.dtype)  # [N, Hq+Hkv, D]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [P * page, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    store_rows(k_flat, slots, rot[:, num_q_heads:])
    store_rows(v_flat, slots, heads[:, num_q_heads + num_kv_heads:])
    return rot[:, :num_q_heads].contiguous()


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def rope_store_kv_kernel(qkv_ptr, pos_ptr, cs_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, w_ptr, eps,
                             HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, KV_FP8: tl.constexpr,
                             KV_MAX: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        half: tl.constexpr = D // 2
        width: tl.constexpr = (HQ + 2 * HKV) * D
        i = tl.arange(0, half)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        cos = tl.load(cs_ptr + pos * D + i)
        sin = tl.load(cs_ptr + pos * D + half + i)
        src = qkv_ptr + tok * width + head * D
        x1 = tl.load(src + i).to(tl.float32)
        x2 = tl.load(src + half + i).to(tl.float32)
        if QK_NORM:  # the head's RMSNorm in fp32, rounded to qkv's dtype as an unfused norm's output
            inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            w = w_ptr + (head >= HQ).to(tl.int64) * D
            x1 = (x1 * inv * tl.load(w + i).to(tl.float32)).to(qkv_ptr.dtype.element_ty).to(tl.float32)
            x2 = (x2 * inv * tl.load(w + half + i).to(tl.float32)).to(qkv_ptr.dtype.element_ty).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if head < HQ:
            q_dst = q_ptr + (tok * HQ + head) * D  # names differ per branch: Triton types them (bf16 / fp8)
            tl.store(q_dst + i, o1.to(q_ptr.dtype.element_ty))
            tl.store(q_dst + half + i, o2.to(q_ptr.dtype.element_ty))
        else:
            kv_head = head - HQ
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            k_dst = k_ptr + (slot * HKV + kv_head) * D
            j = tl.arange(0, D)
            v = tl.load(qkv_ptr + tok * width + (HQ + HKV + kv_head) * D + j).to(tl.float32)
            if KV_FP8:  # saturate, as to_kv: e4m3 has no infinity
                o1 = tl.clamp(o1, -KV_MAX, KV_MAX)
                o2 = tl.clamp(o2, -KV_MAX, KV_MAX)
                v = tl.clamp(v, -KV_MAX, KV_MAX)
            tl.store(k_dst + i, o1.to(k_ptr.dtype.element_ty))
            tl.store(k_dst + half + i, o2.to(k_ptr.dtype.element_ty))
            tl.store(v_ptr + (slot * HKV + kv_head) * D + j, v.to(v_ptr.dtype.element_ty))

    return rope_store_kv_kernel


def rope_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Triton version of `rope_store_kv_ref` (positions must lie inside the table: not checked here)."""
    _check(qkv, positions, cos_sin, slots, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, qk_norm)
    require_cuda(qkv, positions, cos_sin, slots, k_cache, v_cache, qk_norm, what="rope_store_kv")
    assert qkv.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert qk_norm is None or qk_norm.is_contiguous()
    # read by element offsets: an expanded (stride-0) index list would be read past its end (paged_decode.launch)
    assert positions.is_contiguous() and slots.is_contiguous() and cos_sin.is_contiguous(), "contiguous index tensors"
    kernel = _kernel()
    n = qkv.shape[0]
    q = torch.empty((n, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if n:
        kernel[(n, num_q_heads + num_kv_heads)](qkv, positions, cos_sin, slots, q, k_cache, v_cache,
                                                cos_sin if qk_norm is None else qk_norm, eps,
                                                HQ=num_q_heads, HKV=num_kv_heads, D=head_dim,
                                                KV_FP8=k_cache.dtype == FP8_KV, KV_MAX=FP8_KV_MAX,
                                                QK_NORM=qk_norm is not None, **pdl_args(), num_warps=1)
    return q
