"""Paged decode attention (one new query token per sequence) as one Triton kernel, for 16-bit and fp8 pages.

For sequence b and K/V head h, the GROUP = Hq / Hkv query heads that share h attend to the kv_len(b)
cached tokens of b (every token: the new one is the last, already stored):

    out[b, h*G + g] = softmax(q[b, h*G + g] . K[b, :, h]^T * sm_scale) @ V[b, :, h]

Pools are [P, page_size, Hkv, D] (NHD, as `attention.paged_attention_ref` and FlashInfer read them);
the layout is FlashInfer's CSR on the device: kv_indptr [B+1], kv_indices [sum pages],
kv_last_page_len [B] (so kv_len(b) = (pages(b) - 1) * page_size + last(b)). Nothing is planned on the
host: the kernel reads the layout from device memory, so a CUDA graph replays it with new tables.

Why a kernel of our own: FlashInfer 0.5.3's decode over e4m3 pages reads them at 44 % of the H100's
copy bandwidth at 256 rows (docs/PERF.md, session 12): half the bytes of bf16 pages gave a fifth less
time. Here one program owns (sequence, K/V head): it loads its group's queries once, then walks the
sequence's pages BLOCK_N tokens at a time (one gather of page ids, one gather of K and of V rows, each
row D contiguous elements), widens K and V to the queries' dtype in registers, and keeps an online
softmax in fp32 (scores and the running max/sum in fp32, probabilities rounded to the queries' dtype
for the P @ V product, as FlashInfer does). The group is padded to 16 rows for the tensor-core dots.
Measured on the H100: fp16 operands over e4m3 pages cast (one conversion instruction per two values) were slower
than bf16 (94.6 vs 88.4 us a layer at 256 rows); V's tile loaded beside K's at the top of each iteration, 85 vs 89
us over e4m3 pages (the same over bf16). Cast to bf16 (`fp8_words=False`), V's e4m3 tile goes to shared memory as
bytes and is read back one byte at a time to transpose it for the P @ V product (64 one-byte loads a thread per 64
tokens, sm_90, Triton 3.6: Triton moves the cast behind the layout change); a form with both products on K/V-left
warpgroup MMAs read no byte back but was slower (H100, 256 rows: 104 vs 84.5 us a layer at 300 tokens, 317 vs 251 at
1,000) and Triton 3.6 miscompiled it over bf16 pages (session 14): removed. The served form over e4m3 pages
(`fp8_words`, session 21) loads V as 4-byte words and widens them where they were loaded (inline PTX,
`cvt.rn.f16x2.e4m3x2`: exact, two values an instruction, which Triton cannot move), so the tile reaches shared
memory as 16-bit values and the tensor cores through transposing matrix loads, as over bf16 pages; the operands are
fp16 then (e4m3 -> bf16 costs two more conversions a value; fp16 holds every e4m3 value and has the finer mantissa),
the queries clamped to fp16's range (+-65504) first. H200, v2's heads, 300 tokens, per layer: 256 rows 78.3 vs 83.0
us cast, 128 rows 41.7 vs 44.5, 64 rows 22.5 vs 23.9 (1,000 tokens at 256: 233 vs 251; the ranged form at 1 row 6.2
vs 6.3); still 47 % of the e4m3 pages' copy floor at 256 x 300, where by a count of the compiled loop's instructions
(address arithmetic, widening, the 16-row softmax of a group of 3) issuing them takes about as long as the reads
(estimated, not profiled). Triton's interpreter does not run inline PTX: the interpreted tests run the cast form;
the GPU tests run both. Two K/V heads a program (block-diagonal queries over the two heads' side-by-side rows:
18 % fewer compiled instructions a head) was built, interpreter-exact, and measured slower everywhere (H200, session
22, 300 tokens: e4m3 pages 256 rows 80.1 vs 78.0 us, 128 rows 53.0 vs 41.6, 1 row ranged 6.7 vs 5.9; bf16 pages 99.2
vs 88.0 at 256): half the programs, and the work a program saves does not pay for the parallelism lost; removed.

Small batches: one program per (sequence, head) leaves most SMs idle (v2 at one row: 8 programs), so the
ranged form cuts each sequence's tokens into ranges of a fixed length (`RANGE_TOKENS`), each reduced on its own
(running max, sum, unnormalised output; fp32) and written to its slot, and a second launch merges a sequence's
ranges over a fixed number of slots (`max_kv_len` / RANGE_TOKENS). `programs` programs per (sequence, head) share
the ranges round-robin (`decode_splits` picks the count per batch); how many there are changes which program
reduces a range, not how: a sequence's output depends on its own tokens only, the same bits in any batch
(batch-invariant, unlike cutting each sequence into a number of ranges that follows the batch, which session 14
measured: a stream's codes then changed with its step's bucket). H100, v2's heads, per layer (session 14's
batch-sized ranges): 1 row 5.9 us vs 12.7 whole and 9.6 for FlashInfer's best; 16 rows 14.0 vs 16.1 and 17.8;
from 64 rows the whole form is fastest. Merging in the same launch instead (the last program of each (sequence, head)
to finish, counted by an acquire/release atomic, merges its group) was built and measured slower (H200, session 24,
v2 bf16 step: 1 row 2.543 vs 2.462 ms, 32 rows 3.149 vs 3.041; a serial tail where the merge kernel spreads the
heads over programs): removed.

`paged_decode_ref` is the definition (plain torch, any device); `paged_decode` the fast path (CUDA).
"""

from __future__ import annotations

import functools

import torch

from higgs_stream.kernels._triton import pdl_args, require_cuda, triton_modules

LOG2E = 1.4426950408889634
# (block_n, warps, stages): the fastest on an H100 at 64-256 rows over both page types (scripts/bench_attention.py,
# v2's heads, 300 and 1,000 tokens; docs/PERF.md session 13)
TRITON_DECODE_PARAMS = (64, 4, 1)
SPLIT_PROGRAMS = 512  # decode_splits: programs while (sequences x K/V heads x programs) stays within this many
MAX_SPLITS = 16


RANGE_TOKENS = 64  # the ranged form's tokens per range (a multiple of block_n)


def decode_splits(rows: int, kv_heads: int) -> int:
    """Programs per (sequence, K/V head) of the ranged form for a decode batch of `rows` sequences: the largest power of
    two <= MAX_SPLITS that keeps rows x kv_heads x programs <= SPLIT_PROGRAMS (v2's 8 K/V heads: 16 at 1-4 rows, 4 at
    16, 1 from 64). Only speed depends on it, not values (the module docstring)."""
    splits = 1
    while splits < MAX_SPLITS and rows * kv_heads * splits * 2 <= SPLIT_PROGRAMS:
        splits *= 2
    return splits


def kv_lens_of(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    return (kv_indptr[1:] - kv_indptr[:-1] - 1).long() * page_size + kv_last_page_len.long()


def paged_decode_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [B, Hq, D], pools [P, page, Hkv, D] -> [B, Hq, D] in q's dtype (math in >= fp32)."""
    _check(q, k_pool, v_pool, kv_indptr, kv_last_page_len)
    b, hq, d = q.shape
    page, hkv = k_pool.shape[1], k_pool.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    lens = kv_lens_of(kv_indptr, kv_last_page_len, page).tolist()
    ptr = kv_indptr.tolist()
    for i in range(b):
        pages = kv_indices[ptr[i]:ptr[i + 1]].long()
        k = k_pool[pages].reshape(-1, hkv, d)[: lens[i]].to(acc).repeat_interleave(hq // hkv, dim=1)  # [T, Hq, D]
        v = v_pool[pages].reshape(-1, hkv, d)[: lens[i]].to(acc).repeat_interleave(hq // hkv, dim=1)
        probs = (torch.einsum("hd,thd->ht", q[i].to(acc), k) * sm_scale).softmax(dim=-1)
        out[i] = torch.einsum("ht,thd->hd", probs, v).to(q.dtype)
    return out


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, sm_scale: float,
                 out: torch.Tensor | None = None, block_n: int = TRITON_DECODE_PARAMS[0],
                 num_warps: int = TRITON_DECODE_PARAMS[1], num_stages: int = TRITON_DECODE_PARAMS[2],
                 max_kv_len: int | None = None, programs: int | None = None, fp8_words: bool = True) -> torch.Tensor:
    """The Triton version of `paged_decode_ref` (CUDA; pools bf16/fp16/fp32 or e4m3, q 16-bit or fp32).
    `block_n` tokens per iteration (a power of two >= 16; each token finds its own page, so any page size works).
    `max_kv_len`: None, the whole form (one program per sequence and K/V head); else the ranged form (the module
    docstring) for sequences of at most this many tokens, with `programs` programs per sequence and head (None:
    `decode_splits` for this batch). `fp8_words`: over e4m3 pages, V loaded as 4-byte words and widened where loaded,
    with fp16 operands (the module docstring); False: the pages cast to q's dtype as 16-bit pages are (the
    interpreter's form, and the A/B's baseline). CUDA-graph safe."""
    _check(q, k_pool, v_pool, kv_indptr, kv_last_page_len)
    require_cuda(q, k_pool, v_pool, kv_indptr, kv_indices, kv_last_page_len, what="paged_decode")
    if max_kv_len is not None and programs is None:
        programs = decode_splits(q.shape[0], k_pool.shape[2])
    return launch(q, k_pool, v_pool, kv_indptr, kv_indices, kv_last_page_len, sm_scale, out, block_n, num_warps,
                  num_stages, max_kv_len, programs or 1, fp8_words=fp8_words)


def launch(q, k_pool, v_pool, kv_indptr, kv_indices, kv_last_page_len, sm_scale, out=None,
           block_n=TRITON_DECODE_PARAMS[0], num_warps=TRITON_DECODE_PARAMS[1], num_stages=TRITON_DECODE_PARAMS[2],
           max_kv_len=None, programs=1, range_tokens=RANGE_TOKENS, fp8_words=False):
    """The launch itself (no device check: Triton's interpreter runs it on CPU tensors in the tests, where
    `fp8_words` must stay False: the interpreter does not run inline PTX)."""
    b, hq, d = q.shape
    page, hkv = k_pool.shape[1], k_pool.shape[2]
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}"
    assert q.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous(), "contiguous q and pools"
    # the kernel reads the layout by element offsets: a strided (e.g. expanded) table would be read past its end
    assert all(t.is_contiguous() for t in (kv_indptr, kv_indices, kv_last_page_len)), "contiguous CSR tensors"
    assert programs >= 1, f"programs must be >= 1, got {programs}"
    group = hq // hkv
    words = fp8_words and k_pool.dtype == torch.float8_e4m3fn
    assert not words or d % 16 == 0, f"e4m3 pages as words need a head size divisible by 16, got {d}"
    out = torch.empty_like(q) if out is None else out
    if not b:
        return out
    part = ml = out
    ranged = max_kv_len is not None
    slots = 1
    if ranged:  # per (sequence, query head, range slot): the unnormalised output and (running max, sum), fp32
        assert range_tokens % block_n == 0, f"ranges of {range_tokens} tokens are not whole blocks of {block_n}"
        slots = max(1, -(-max_kv_len // range_tokens))
        part = torch.empty((b, hq, slots, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((b, hq, slots, 2), dtype=torch.float32, device=q.device)
    _kernel()[(b, hkv, programs if ranged else 1)](
        q, k_pool, v_pool, out, part, ml, kv_indptr, kv_indices, kv_last_page_len, sm_scale * LOG2E, HKV=hkv,
        GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), D=d, PAGE=page, BLOCK_N=block_n,
        PROGRAMS=programs if ranged else 1, RANGE=range_tokens if ranged else 0, SLOTS=slots, FP8_WORDS=words,
        **pdl_args(), num_warps=num_warps, num_stages=num_stages)
    if ranged:
        _merge_kernel()[(b, hq)](part, ml, out, kv_indptr, kv_last_page_len, D=d, PAGE=page,
                                 RANGE=range_tokens, SLOTS=slots, SLOTS_PAD=1 << (slots - 1).bit_length(),
                                 **pdl_args(), num_warps=4)
    return out


def _check(q, k_pool, v_pool, kv_indptr, kv_last_page_len) -> None:
    assert q.dim() == 3 and k_pool.dim() == 4, f"q [B, Hq, D], pools [P, page, Hkv, D]; got {q.shape}, {k_pool.shape}"
    assert k_pool.shape == v_pool.shape and k_pool.shape[3] == q.shape[2], f"pools {k_pool.shape} vs q {q.shape}"
    assert q.shape[1] % k_pool.shape[2] == 0, f"{q.shape[1]} query heads over {k_pool.shape[2]} K/V heads"
    assert kv_indptr.shape == (q.shape[0] + 1,) and kv_last_page_len.shape == (q.shape[0],), "CSR of B sequences"


@functools.cache
def _words_in_order():
    triton, tl = triton_modules()

    @triton.jit
    def words_in_order(e0, e1, e2, e3, ROWS: tl.constexpr, D: tl.constexpr):
        """Four [ROWS, D // 4] tensors, e_k holding byte k of each 4-byte word (widened) -> [ROWS, D] in memory order.
        `tl.join` puts its new axis last, so [.., w, i, j] of the nested joins is byte 2i + j of word w."""
        return tl.reshape(tl.join(tl.join(e0, e2), tl.join(e1, e3)), (ROWS, D))

    return words_in_order


@functools.cache
def _kernel():
    triton, tl = triton_modules()
    words_in_order = _words_in_order()

    @triton.jit
    def paged_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, part_ptr, ml_ptr, indptr_ptr, indices_ptr, last_ptr,
                            scale_log2, HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                            D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PROGRAMS: tl.constexpr,
                            RANGE: tl.constexpr, SLOTS: tl.constexpr, FP8_WORDS: tl.constexpr,
                            PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        h = tl.program_id(1)
        first = tl.load(indptr_ptr + b)
        num_pages = tl.load(indptr_ptr + b + 1) - first
        kv_len = (num_pages - 1) * PAGE + tl.load(last_ptr + b)
        if RANGE == 0:  # the whole form: one range, the whole sequence
            n_ranges = 1
            span = kv_len
        else:  # (kv_len <= max_kv_len: the engine's positions never pass it; the clamp keeps stores in their slots)
            n_ranges = tl.minimum(tl.cdiv(kv_len, RANGE), SLOTS)
            span = RANGE
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK_N)
        heads = h * GROUP + g
        base = b.to(tl.int64) * (HKV * GROUP * D)
        q_rows = base + heads[:, None] * D + d[None, :]  # [GROUP_PAD, D]
        q_ok = g[:, None] < GROUP
        q = tl.load(q_ptr + q_rows, mask=q_ok, other=0.0)
        if FP8_WORDS:  # fp16 operands: e4m3 widens to fp16 exactly, one instruction per two values
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
            w = tl.arange(0, D // 4)
        for r in range(tl.program_id(2), n_ranges, PROGRAMS):  # this program's ranges, each reduced on its own
            lo = r * span
            hi = tl.minimum(kv_len, lo + span)
            m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
            l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
            acc = tl.zeros((GROUP_PAD, D), dtype=tl.float32)
            for start in range(lo, hi, BLOCK_N):
                tok = start + n
                live = tok < hi
                page = tl.load(indices_ptr + first + tok // PAGE, mask=live, other=0)
                rows = (page.to(tl.int64) * PAGE + tok % PAGE) * (HKV * D) + h * D  # [BLOCK_N] element offsets
                kv_off = rows[:, None] + d[None, :]
                k = tl.load(k_ptr + kv_off, mask=live[:, None], other=0.0).to(q.dtype)  # [BLOCK_N, D]
                if FP8_WORDS:  # V as 4-byte words, widened where they were loaded (the module docstring)
                    words = tl.load(v_ptr.to(tl.pointer_type(tl.int32)) + (rows // 4)[:, None] + w[None, :],
                                    mask=live[:, None], other=0)
                    e0, e1, e2, e3 = tl.inline_asm_elementwise(
                        asm="{ .reg .b32 a, b; .reg .b16 l, h; mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 a, l; "
                            "cvt.rn.f16x2.e4m3x2 b, h; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
                        constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
                    v = words_in_order(e0, e1, e2, e3, BLOCK_N, D)
                else:
                    v = tl.load(v_ptr + kv_off, mask=live[:, None], other=0.0).to(q.dtype)  # issued beside K's load
                s = tl.dot(q, tl.trans(k)) * scale_log2  # [GROUP_PAD, BLOCK_N] fp32, log2 units
                s = tl.where(live[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
                m_i = m_new
            if RANGE == 0:
                tl.store(o_ptr + q_rows, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=q_ok)
            else:  # the range's partial sums in its slot; the merge kernel normalises
                row = b.to(tl.int64) * (HKV * GROUP) + heads  # [GROUP_PAD] query-head rows
                ok = g < GROUP
                tl.store(ml_ptr + (row * SLOTS + r) * 2, m_i, mask=ok)
                tl.store(ml_ptr + (row * SLOTS + r) * 2 + 1, l_i, mask=ok)
                tl.store(part_ptr + (row[:, None] * SLOTS + r) * D + d[None, :], acc, mask=q_ok)

    return paged_decode_kernel


@functools.cache
def _merge_kernel():
    triton, tl = triton_modules()

    @triton.jit
    def merge_splits_kernel(part_ptr, ml_ptr, o_ptr, indptr_ptr, last_ptr, D: tl.constexpr,
                            PAGE: tl.constexpr, RANGE: tl.constexpr, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr,
                            PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0)
        row = b.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)  # (sequence, query head)
        kv_len = (tl.load(indptr_ptr + b + 1) - tl.load(indptr_ptr + b) - 1) * PAGE + tl.load(last_ptr + b)
        s = tl.arange(0, SLOTS_PAD)
        ok = s < tl.minimum(tl.cdiv(kv_len, RANGE), SLOTS)  # the sequence's ranges (slots past them were not written)
        m = tl.load(ml_ptr + (row * SLOTS + s) * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + (row * SLOTS + s) * 2 + 1, mask=ok, other=0.0)
        w = tl.exp2(m - tl.max(m, axis=0))  # range 0 always holds tokens: a finite max
        w = tl.where(ok, w, 0.0)
        d = tl.arange(0, D)
        acc = tl.load(part_ptr + (row * SLOTS + s[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
        tl.store(o_ptr + row * D + d, out.to(o_ptr.dtype.element_ty))

    return merge_splits_kernel
