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
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from higgs_stream.kernels._triton import require_cuda, triton_modules


def _check(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    assert q.dtype == torch.int8 and q.dim() == 2, f"q must be int8 [N, K], got {q.dtype} {tuple(q.shape)}"
    assert x.shape[-1] == q.shape[1], f"x [..., {x.shape[-1]}] vs q [N, {q.shape[1]}]"
    assert scale.shape == (q.shape[0],) and scale.dtype == torch.float32, "scale must be fp32 [N]"


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] float -> [..., N] in x's dtype: (x @ q^T) * scale, in fp32."""
    _check(x, q, scale)
    return (F.linear(x.float(), q.float()) * scale).to(x.dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fast version of `int8_linear_ref` (CPU: ATen's int8 kernel; CUDA: Triton)."""
    _check(x, q, scale)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    if x.device.type == "cpu":
        out = _cpu(x2, q, scale).to(x.dtype)
    else:
        require_cuda(x2, q, scale, what="int8_linear")
        out = triton_linear(x2, q, scale)
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
           blocks: tuple[int, int, int, int, int] | None = None) -> None:
    """Launch the (compiled or interpreted) kernel over out [M, N] (contiguous operands). The weight
    (int8, or e4m3 under bf16 activations) is widened to x's dtype in registers.
    `blocks`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), default `block_sizes(M)`."""
    assert x.is_contiguous() and q.is_contiguous() and out.is_contiguous(), "operands must be contiguous"
    m, k = x.shape
    n = q.shape[0]
    bm, bn, bk, warps, stages = blocks or block_sizes(m)
    grid = (-(-m // bm), -(-n // bn))
    kernel[grid](x, q, scale, out, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=x.dtype == torch.float32,
                 W_FLOAT=q.dtype.is_floating_point, num_warps=warps, num_stages=stages)


def build_kernel():
    """The Triton kernel (uncached: a test builds it under TRITON_INTERPRET=1 to run it on the CPU).
    W_FLOAT: the weight is a float type (e4m3), which needs a float fill."""
    triton, tl = triton_modules()

    @triton.jit
    def quantized_linear_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                IEEE: tl.constexpr, W_FLOAT: tl.constexpr):
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
            else:
                acc = tl.dot(x, wt, acc)
        s = tl.load(s_ptr + cols, mask=col_ok, other=0.0)
        y = acc * s[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    return quantized_linear_kernel


@functools.cache
def _kernel():
    return build_kernel()
