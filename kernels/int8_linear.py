"""Int8 weight-only linear: y = x @ (q * scale)^T with q [N, K] int8 and one fp32 scale per output
channel (scale [N]); activations stay in their float dtype.

`int8_linear_ref` is the definition (fp32 math, one cast); `int8_linear` the fast path:

* CPU: torch's own `aten._weight_int8pack_mm`. Its vectorized kernel (AVX512/AVX2) takes bf16
  activations and reads 16 (AVX512) or 8 (AVX2) values of K per step with aligned loads: with K a
  multiple of 16 and 32-byte aligned rows it is used in bf16 (activations rounded to bf16 once, fp32
  accumulation, scales applied in fp32 after: ~2^-8 relative to |x| @ |w|^T); with any other K its
  fp32 version runs (scalar, exact to fp32, slow). Its bf16 kernel given another K reads past the
  rows (NaN, or a segfault: torch 2.11), so it is never called so.
* CUDA: a Triton kernel that converts each int8 weight tile in registers and accumulates in fp32
  (the weight is read once, as int8). `triton_linear` also serves fp8's small batches with it (e4m3
  weights widened the same way: kernels/fp8_linear.py). torch's CUDA `_weight_int8pack_mm` is a one-thread-per-output
  kernel, and torchao's int8 weight-only linear is `mm(x, q.to(x.dtype)) * scale` (fast only when
  torch.compile fuses it; eager under a CUDA graph it writes and re-reads a bf16 copy of the weight).

The Triton tile sizes depend only on the batch-size class (M <= 16 or not) and never split K, so a
row's result does not depend on the other rows of a small batch (batch-invariant decode steps).

`triton_gemv` (decode steps of 1-2 rows by default, ModelRunnerConfig.cuda_core_gemv_rows; scripts/sweep_gemv.py): the
same product for 1-4 rows on CUDA cores (also over plain bf16 weights, unscaled, with an optional bias: the plain
linears engine/gemv_choice.py finds faster on it than cuBLAS), each weight tile widened to fp32 and reduced along wide
K tiles (512-2048),
so a program keeps more of its weight rows in flight and walks K in few steps. Why: at M = 1 the tensor-core kernel pads M to 16 and walks K in 256/512-wide steps
with 3 in flight, one program per 32 output channels; v2's o and down projections then run 96 programs on 132 SMs,
each a chain of 12-16 dependent steps, and take 9.4 / 18.6 us against 3.1 / 8.4 us of weight reading (H100, fp8;
docs/PERF.md session 14).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os

import torch
import torch.nn.functional as F

from higgs_stream.kernels._triton import pdl_args, require_cuda, triton_modules


def _check(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    assert q.dtype == torch.int8 and q.dim() == 2, f"q must be int8 [N, K], got {q.dtype} {tuple(q.shape)}"
    assert x.shape[-1] == q.shape[1], f"x [..., {x.shape[-1]}] vs q [N, {q.shape[1]}]"
    assert scale.shape == (q.shape[0],) and scale.dtype == torch.float32, "scale must be fp32 [N]"


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] float -> [..., N] in x's dtype: (x @ q^T) * scale, in fp32."""
    _check(x, q, scale)
    return (F.linear(x.float(), q.float()) * scale).to(x.dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, cuda_core_rows: int = 0) -> torch.Tensor:
    """The fast version of `int8_linear_ref` (CPU: ATen's int8 kernel; CUDA: Triton; up to `cuda_core_rows` rows,
    at most GEMV_ROWS_MAX, the CUDA-core `triton_gemv`)."""
    _check(x, q, scale)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    if x.device.type == "cpu":
        out = _cpu(x2, q, scale).to(x.dtype)
    else:
        require_cuda(x2, q, scale, what="int8_linear")
        out = (triton_gemv(x2, q, scale) if x2.shape[0] <= min(cuda_core_rows, GEMV_ROWS_MAX)
               else triton_linear(x2, q, scale))
    return out.view(*lead, q.shape[0])


def triton_linear(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  blocks: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x2 [M, K] @ q^T (CUDA, contiguous) * scale[None, :] -> [M, N] in x2's dtype through the Triton
    kernel: int8 or e4m3 weights widened to x2's dtype in registers (kernels/fp8_linear.py's small
    batches pass their own `blocks`)."""
    out = torch.empty((x2.shape[0], q.shape[0]), dtype=x2.dtype, device=x2.device)
    if x2.shape[0]:
        launch(_kernel(), x2, q, scale, out, blocks=blocks)
    return out


def cpu_vectorized(k: int, q: torch.Tensor) -> bool:
    """Whether ATen's vectorized bf16 kernel can run this K and weight (see the module docstring)."""
    return k % 16 == 0 and q.data_ptr() % 32 == 0


def _cpu(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[M, K] float -> [M, N] fp32 through ATen's int8 kernel."""
    if not cpu_vectorized(x2.shape[1], q):
        return torch.ops.aten._weight_int8pack_mm(x2.float(), q, scale)  # scalar fp32 kernel, any shape
    a = x2.to(torch.bfloat16)
    if a.data_ptr() % 64 or a.data_ptr() == x2.data_ptr():  # a fresh, aligned copy for the aligned loads
        a = a.clone()
    ones = torch.ones(q.shape[0], dtype=torch.bfloat16)  # the fp32 scales are applied after, unrounded
    return torch.ops.aten._weight_int8pack_mm(a, q, ones).float() * scale


def block_sizes(m: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows. BLOCK_K is the same for
    every M (the K reduction is summed in the same order whatever the batch)."""
    if m <= 16:  # decode at small batch: weight-read bound, narrow N tiles for enough programs
        return 16, 32, 128, 4, 4
    return 64, 64, 128, 4, 3


def launch(kernel, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
           blocks: tuple[int, int, int, int, int] | None = None, x_scale: torch.Tensor | None = None,
           acc_every: int = 0) -> None:
    """Launch the (compiled or interpreted) kernel over out [M, N] (contiguous operands). The weight
    (int8, or e4m3 under bf16 activations) is widened to x's dtype in registers; e4m3 x (with its fp32
    per-row `x_scale` [M]) over e4m3 weights multiplies on fp8 tensor cores, adding its products into the fp32
    accumulator every `acc_every` of K (0: Triton's default on Hopper, the fp8 MMA's own reduced-precision sums
    over the whole K; cuBLAS's precise mode, what torch._scaled_mm runs here, promotes them regularly).
    `blocks`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), default `block_sizes(M)`."""
    assert x.is_contiguous() and q.is_contiguous() and out.is_contiguous(), "operands must be contiguous"
    m, k = x.shape
    n = q.shape[0]
    bm, bn, bk, warps, stages = blocks or block_sizes(m)
    grid = (-(-m // bm), -(-n // bn))
    kernel[grid](x, q, scale, scale if x_scale is None else x_scale, out, m, n, k, BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, IEEE=x.dtype == torch.float32, W_FLOAT=q.dtype.is_floating_point,
                 X_SCALED=x_scale is not None, ACC_EVERY=acc_every, **pdl_args(), num_warps=warps, num_stages=stages)


def build_kernel():
    """The Triton kernel (uncached: a test builds it under TRITON_INTERPRET=1 to run it on the CPU).
    W_FLOAT: the weight is a float type (e4m3), which needs a float fill. X_SCALED: x carries per-row scales
    (`xs_ptr`, fp32 [M]; unread otherwise)."""
    triton, tl = triton_modules()

    @triton.jit
    def quantized_linear_kernel(x_ptr, q_ptr, s_ptr, xs_ptr, out_ptr, M, N, K: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                IEEE: tl.constexpr, W_FLOAT: tl.constexpr, X_SCALED: tl.constexpr,
                                ACC_EVERY: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        ks = tl.arange(0, BLOCK_K)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(tl.cdiv(K, BLOCK_K)):
            kk = i * BLOCK_K + ks
            k_ok = kk < K
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
            w_ptrs = q_ptr + cols[:, None].to(tl.int64) * K + kk[None, :]
            if W_FLOAT:  # e4m3 (a float fill: an int one does not cast to e4m3)
                w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0)
            wt = tl.trans(w.to(x.dtype))  # int8 or e4m3 -> bf16/fp16/fp32 is exact
            if IEEE:  # fp32 activations: true fp32 products, not TF32
                acc = tl.dot(x, wt, acc, input_precision="ieee")
            elif ACC_EVERY > 0:  # fp8 x fp8: the MMA's partial sums promoted into fp32 every ACC_EVERY of K
                acc = tl.dot(x, wt, acc, max_num_imprecise_acc=ACC_EVERY)
            else:
                acc = tl.dot(x, wt, acc)
        s = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
        y = acc * s[None, :]
        if X_SCALED:  # per-row activation scales (x quantized per token)
            y = y * tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[:, None]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    return quantized_linear_kernel


def triton_scaled_linear(xq: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                         out_dtype: torch.dtype = torch.bfloat16,
                         blocks: tuple[int, int, int, int, int] | None = None, acc_every: int = 0) -> torch.Tensor:
    """(xq [M, K] e4m3 @ q [N, K]^T e4m3) * x_scale[:, None] * w_scale[None, :] -> [M, N] out_dtype (CUDA): the same
    kernel on fp8 tensor cores; what `torch._scaled_mm` computes, with the tiles chosen here. Not served: timed
    against torch's scaled GEMM by scripts/sweep_gemv.py (--w8a8-batches); with `acc_every` 128 (as precise as
    torch's) 5 % faster a v2 layer at 32-64 rows and slower from 128 (H100, session 15), too little to route to it."""
    out = torch.empty((xq.shape[0], q.shape[0]), dtype=out_dtype, device=xq.device)
    if xq.shape[0]:
        launch(_kernel(), xq, q, w_scale, out, blocks=blocks or block_sizes(xq.shape[0]), x_scale=x_scale,
               acc_every=acc_every)
    return out


@functools.cache
def _kernel():
    return build_kernel()


GEMV_ROWS_MAX = 4  # rows triton_gemv serves (one reduction per row, unrolled)
# (BLOCK_N, BLOCK_K, warps, stages) by K (`gemv_blocks`): (8, 1024, 4, 3) was the fastest over a v2 layer's four fp8
# linears at one row of a 9-configuration grid (BN 8/16/32 x BK 512/1024/2048; scripts/sweep_gemv.py, H100, session 15):
# 46.3 us a layer vs 62.2 for the tensor-core kernel; at 4 rows 99.3 vs 76.3 (ModelRunnerConfig.cuda_core_gemv_rows is
# 2). Per linear, K = 8192 (v2's down projection) was faster with K tiles of 2048 on both cards: one row H100 11.6 vs
# 12.7 us (session 15), H200 10.3 vs 11.6 (session 22; two rows 13.0 vs 16.1); the K = 3072 linears' best stayed 1024.
# Higgs v3's down projection (K = 9728) follows the rule unmeasured; Qwen3-TTS's linears (K <= 6144) keep 1024.
GEMV_BLOCK_K_WIDE_FROM = 8192  # K from which the GEMV's K tiles are 2048 wide
GEMV_BLOCKS: tuple[int, int, int, int] | None = None  # benchmarks: one for every K (bench_quant --gemv-blocks)


def gemv_blocks(k: int) -> tuple[int, int, int, int]:
    """The CUDA-core GEMV's (BLOCK_N, BLOCK_K, warps, stages) for a reduction over `k` (GEMV_BLOCKS when set)."""
    if GEMV_BLOCKS is not None:
        return GEMV_BLOCKS
    return (8, 2048 if k >= GEMV_BLOCK_K_WIDE_FROM else 1024, 4, 3)


# Plain bf16 weights (engine/gemv_choice.py): K tiles of 2048 from K = 2048, else 1024. scripts/sweep_gemv.py
# --weights bf16 --linears qwen3-1.7b, H200, session 25, us at 1 / 2 / 4 rows: the code predictor's o projection
# (N 1024, K 2048) 5.6 / 4.3 / 5.3 with 2048-wide tiles vs 7.9 / 5.4 / 7.3 with 1024 (cuBLAS 12.9 / 12.9 / 8.5); at
# K = 1024 the two equal within 0.3.
PLAIN_GEMV_BLOCK_K_WIDE_FROM = 2048


def plain_gemv_blocks(k: int) -> tuple[int, int, int, int]:
    """The GEMV's (BLOCK_N, BLOCK_K, warps, stages) for a plain (bf16) weight over `k`."""
    return (8, 2048 if k >= PLAIN_GEMV_BLOCK_K_WIDE_FROM else 1024, 4, 3)


def triton_gemv(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None,
                blocks: tuple[int, int, int, int] | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M <= GEMV_ROWS_MAX, K] @ q^T * scale[None, :] (+ bias) -> [M, N] in x2's dtype (CUDA, contiguous; int8 or
    e4m3 weights with their fp32 scales, or a plain float weight, bf16/fp16, with `scale` None) on CUDA cores: fp32
    products and sums, one reduction over each BLOCK_K-wide tile per row, then the scale and the bias (`bias` [N], any
    float dtype) in fp32 and one rounding. Each row's sums run in the same order whatever M is (the rows are separate
    reductions of the same tile)."""
    m, k = x2.shape
    assert m <= GEMV_ROWS_MAX, f"triton_gemv serves up to {GEMV_ROWS_MAX} rows, got {m}"
    assert x2.is_contiguous() and q.is_contiguous(), "operands must be contiguous"
    assert (scale is None) == (q.dtype in (torch.bfloat16, torch.float16, torch.float32)), \
        "a scale goes with an int8 / e4m3 weight, none with a float one"
    assert bias is None or (bias.shape == (q.shape[0],) and bias.is_contiguous()), "bias must be [N], contiguous"
    out = torch.empty((m, q.shape[0]), dtype=x2.dtype, device=x2.device)
    if m:
        launch_gemv(_gemv_kernel(), x2, q, scale, out, blocks, bias)
    return out


def launch_gemv(kernel, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor,
                blocks: tuple[int, int, int, int] | None = None, bias: torch.Tensor | None = None,
                warmup: bool = False) -> None:
    """Launch the (compiled or interpreted) GEMV kernel over out [M, N] (`blocks` None: `gemv_blocks(K)`; `scale`
    None: unscaled, a float weight; `bias` None: none). `warmup`: compile it for these arguments, launch nothing
    (the tensors may be Triton's MockTensors: dtype and shape only)."""
    m, k = x.shape
    n = q.shape[0]
    bn, bk, warps, stages = blocks or gemv_blocks(k)
    grid = (-(-n // bn),)
    run = functools.partial(kernel.warmup, grid=grid) if warmup else kernel[grid]
    run(x, q, out if scale is None else scale, out if bias is None else bias, out, m, n, k,
        ROWS=m, ROWS_PAD=1 << (m - 1).bit_length(), BLOCK_N=bn, BLOCK_K=bk,
        W_FLOAT=q.dtype.is_floating_point, SCALED=scale is not None, BIAS=bias is not None,
        **pdl_args(), num_warps=warps, num_stages=stages)


COMPILE_WORKERS = 16  # compile_plain_gemv's threads at most


def compile_plain_gemv(cases: list[tuple[int, int, int]], dtype: torch.dtype, workers: int | None = None) -> None:
    """Compile the GEMV over a plain `dtype` weight (unscaled, no bias, `plain_gemv_blocks`) for each (rows, N, K) of
    `cases`, in up to `workers` threads at once (None: one a CPU core, at most COMPILE_WORKERS), launching nothing.
    Why: each (K, rows) is its own compile (~1.5 s on an empty Triton cache, most of it in LLVM and ptxas, which run
    beside each other in threads), and engine/gemv_choice.py's timing asked for them one after another. Triton's
    AsyncCompileMode runs the compiles in the pool and files each kernel under the key a real call computes
    (aligned pointers, M's and N's values), so those calls compile nothing; PDL as `pdl_args` says now. A compile
    that fails raises here (CUDA, on the current device)."""
    from triton.runtime.jit import MockTensor

    triton, _ = triton_modules()
    kernel = _gemv_kernel()
    workers = workers or min(COMPILE_WORKERS, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(cases)))) as pool, \
            triton.AsyncCompileMode(pool):
        for m, n, k in cases:
            assert 1 <= m <= GEMV_ROWS_MAX, f"rows must be in 1..{GEMV_ROWS_MAX}, got {m}"
            x, out = MockTensor(dtype, [m, k]), MockTensor(dtype, [m, n])
            launch_gemv(kernel, x, MockTensor(dtype, [n, k]), None, out, plain_gemv_blocks(k), warmup=True)


def build_gemv_kernel():
    """The GEMV kernel (uncached: the interpreter test builds it under TRITON_INTERPRET=1). SCALED: multiply by the
    per-column scales (`s_ptr`, fp32 [N]); BIAS: add `b_ptr` [N] (each unread otherwise)."""
    triton, tl = triton_modules()

    @triton.jit
    def quantized_gemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, M, N, K: tl.constexpr, ROWS: tl.constexpr,
                              ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_FLOAT: tl.constexpr,
                              SCALED: tl.constexpr = True, BIAS: tl.constexpr = False, PDL: tl.constexpr = False):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        col_ok = cols < N
        if PDL:  # programmatic dependent launch (kernels/_triton.py)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        ks = tl.arange(0, BLOCK_K)
        r = tl.arange(0, ROWS_PAD)
        acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
        for i in range(tl.cdiv(K, BLOCK_K)):
            kk = i * BLOCK_K + ks
            k_ok = kk < K
            w_ptrs = q_ptr + cols[:, None].to(tl.int64) * K + kk[None, :]
            if W_FLOAT:  # e4m3 or a float weight (a float fill)
                w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0)
            wf = w.to(tl.float32)  # [BN, BK], exact
            for row in tl.static_range(ROWS):
                xr = tl.load(x_ptr + row * K + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
                part = tl.sum(wf * xr[None, :], axis=1)  # [BN]
                acc = tl.where(r[:, None] == row, acc + part[None, :], acc)
        y = acc
        if SCALED:
            y = y * tl.load(s_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if BIAS:
            y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + r[:, None].to(tl.int64) * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=(r[:, None] < M) & col_ok[None, :])

    return quantized_gemv_kernel


@functools.cache
def _gemv_kernel():
    return build_gemv_kernel()
