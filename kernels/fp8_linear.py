"""FP8 (e4m3) linear with per-output-channel weight scales; activations quantized per token at run time
above GEMV_MAX_M rows, kept in their float dtype up to it:

    M > GEMV_MAX_M (prefill, large decode batches; w8a8):
      x_scale[m] = max(amax(|x[m, :]|), EPS) * fp32(1/448)    # one fp32 scale per row (token)
      xq = e4m3(x / x_scale)                                   # round to nearest even, |xq| <= 448
      y  = (xq @ q^T) * x_scale[:, None] * w_scale[None, :]   # fp32 accumulation, out in x's dtype
    M <= GEMV_MAX_M (decode at small batch; weight-only):
      y  = (x @ q^T) * w_scale[None, :]                        # e4m3 weights widened, fp32 accumulation

`q` [N, K] e4m3 and `w_scale` [N] fp32 come from quantizing the weight once at load (the engine's
quantize.py, the same rule per output channel).

`fp8_linear_ref` / `quantize_per_token_ref` are the definitions (plain torch, any device: fp8 is
emulated as exact products of e4m3 values with fp32 sums). `fp8_linear` is the fast path (CUDA,
compute capability >= 8.9). Above GEMV_MAX_M rows one Triton kernel quantizes the activations per
token and torch's row-wise scaled GEMM (`torch._scaled_mm` with scale_a [M, 1] and scale_b [1, N]:
cuBLASLt on Hopper with cuBLAS >= 12.9, torch's CUTLASS kernel otherwise; what torchao's
`Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())` calls by default) multiplies. Up to
GEMV_MAX_M rows the GEMM only streams the weight: the narrow-tile Triton kernel of
kernels/int8_linear.py reads the e4m3 weight, widens it to bf16 in registers and multiplies the bf16
activations, in one launch (no quantization launch, no activation rounding). Measured on an H100
(scripts/sweep_gemv.py, weights read from HBM, 2026-11-27): a v2 layer's four linears at M = 1 took
71.3 us with the quantization launch and e4m3 x e4m3 in the same kernel, 62.5 us weight-only at
`gemv_blocks` (bf16 cuBLAS 82.9), and the output's max error against the fp32 product fell from
3.5-4.4% to 2.5-2.9% of its peak. All CUDA-graph safe (no host synchronisation). The scaled GEMM needs
N and K multiples of 16; a linear of another shape (none in the served models) runs the same
quantization and an fp32 matmul of the e4m3 values instead.

The scale is a product with the fp32 reciprocal, not a division: torch's CUDA division of a tensor by
a scalar multiplies by the reciprocal, its CPU one divides, and a product is rounded the same way by
every device and by the Triton kernel (the per-token scales are equal bit for bit, tested on the GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from higgs_stream.kernels._triton import pdl_args, require_cuda, triton_modules
from higgs_stream.kernels.int8_linear import GEMV_ROWS_MAX, triton_gemv, triton_linear

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # its fp32 reciprocal, exactly
GEMM_ALIGN = 16  # torch._scaled_mm: both matrix dimensions multiples of 16
EPS = 1e-12  # amax floor: an all-zero row gets a tiny scale instead of a division by zero
# rows up to which the Triton kernel multiplies weight-only (the w8a8 scaled GEMM above); read at each call, so a
# benchmark may set it (bench_quant --fp8-weight-only-rows) before the graphs are captured
GEMV_MAX_M = 16


@dataclass(frozen=True)
class Fp8Rows:
    """Activations already quantized per token, as `quantize_per_token` would from their bf16 values: e4m3
    [M, K] and fp32 scales [M] (the fused norm and SiLU of kernels/fused_norm.py and kernels/activation.py
    write them, so the linear after them skips its quantization launch). Only for M > GEMV_MAX_M rows, where
    `fp8_linear` quantizes activations."""

    q: torch.Tensor  # [M, K] float8_e4m3fn
    scale: torch.Tensor  # [M] fp32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def gemv_blocks(k: int) -> tuple[int, int, int, int, int]:
    """The Triton kernel's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for fp8 weights at M <= GEMV_MAX_M:
    the fastest of a grid on an H100 for v2's linears (scripts/sweep_gemv.py): K tiles of 256, of
    512 for the long-K down projection. Depends on K only, so a row never depends on the others."""
    return 16, 32, 512 if k >= 8192 else 256, 4, 3


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (e4m3 [M, K], fp32 scale [M]) with one scale per row (max |x| -> 448)."""
    assert x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}"
    xf = x.float()
    scale = xf.abs().amax(dim=1).clamp(min=EPS) * INV_FP8_MAX  # [M]
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


quantize_per_token_ref = quantize_rows_ref  # activations: one row per token


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, gemv_max_m: int | None = None
                   ) -> torch.Tensor:
    """x [..., K] float, q [N, K] e4m3, w_scale [N] fp32 -> [..., N] in x's dtype (emulated in fp32):
    weight-only up to `gemv_max_m` rows (None: GEMV_MAX_M), activations quantized per token above (the module
    docstring)."""
    _check(x, q, w_scale)
    gemv_max_m = GEMV_MAX_M if gemv_max_m is None else gemv_max_m
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] <= gemv_max_m:
        y = (x2.float() @ q.float().t()) * w_scale[None, :]
    else:
        xq, x_scale = quantize_per_token_ref(x2)
        y = (xq.float() @ q.float().t()) * x_scale[:, None] * w_scale[None, :]  # [M, N] fp32
    return y.to(x.dtype).view(*lead, q.shape[0])


def fp8_linear(x: torch.Tensor | Fp8Rows, q: torch.Tensor, w_scale: torch.Tensor, fast_accum: bool = False,
               gemv_max_m: int | None = None, cuda_core_rows: int = 0) -> torch.Tensor:
    """The fast version of `fp8_linear_ref` (CUDA, sm89+; x bf16): up to `gemv_max_m` (None: GEMV_MAX_M) rows the Triton
    kernel (weight-only; up to `cuda_core_rows` rows, at most int8_linear.GEMV_ROWS_MAX, the CUDA-core
    `triton_gemv` instead, the same weight-only product), above them the per-token quantization and the scaled
    GEMM (`gemv_max_m=0`: always the latter; benchmarks). `fast_accum`: cuBLAS/CUTLASS fast accumulation (Hopper's
    reduced-precision fp8 accumulator) in the scaled GEMM; off by default. `x` may be `Fp8Rows` (more than
    `gemv_max_m` rows, quantized by a fused kernel before): the GEMM alone then, bf16 out."""
    gemv_max_m = GEMV_MAX_M if gemv_max_m is None else gemv_max_m
    if isinstance(x, Fp8Rows):
        assert x.q.dim() == 2 and x.q.shape[0] > gemv_max_m, "Fp8Rows are for the scaled GEMM's row counts"
        return _scaled_gemm(x.q, x.scale, q, w_scale, torch.bfloat16, fast_accum)
    _check(x, q, w_scale)
    require_cuda(x, q, w_scale, what="fp8_linear")
    assert x.dtype == torch.bfloat16, f"fp8_linear's row-wise scaled GEMM writes bf16; x is {x.dtype}"
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty(*lead, q.shape[0])
    if x2.shape[0] <= min(cuda_core_rows, gemv_max_m, GEMV_ROWS_MAX):
        return triton_gemv(x2.contiguous(), q, w_scale).view(*lead, q.shape[0])
    if x2.shape[0] <= gemv_max_m:
        return triton_linear(x2.contiguous(), q, w_scale, blocks=gemv_blocks(k)).view(*lead, q.shape[0])
    xq, x_scale = quantize_per_token(x2)
    return _scaled_gemm(xq, x_scale, q, w_scale, x.dtype, fast_accum).view(*lead, q.shape[0])


def _scaled_gemm(xq: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """(xq @ q^T) * x_scale[:, None] * w_scale[None, :] -> [M, N] out_dtype. torch's scaled GEMM, not the Triton
    kernel's fp8 tiles (int8_linear.triton_scaled_linear): with its sums promoted into fp32 as here, those were 5 %
    faster a layer at 32-64 rows, the whole step 2 %, and slower from 128 rows (H100, session 15; docs/PERF.md)."""
    assert xq.dtype == FP8 and xq.shape[1] == q.shape[1], f"xq {xq.dtype} {tuple(xq.shape)} vs q {tuple(q.shape)}"
    if q.shape[0] % GEMM_ALIGN or q.shape[1] % GEMM_ALIGN:  # no scaled GEMM for this shape: the same math in fp32
        return ((xq.float() @ q.float().t()) * x_scale[:, None] * w_scale[None, :]).to(out_dtype)
    return torch._scaled_mm(xq, q.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], out_dtype=out_dtype,
                            use_fast_accum=fast_accum)  # [M, N]; q.t() is the column-major operand


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `quantize_per_token_ref` (CUDA): one program per row, two passes over K."""
    assert x.dim() == 2, f"x must be [M, K], got {tuple(x.shape)}"
    require_cuda(x, what="quantize_per_token")
    x = x.contiguous()
    m, k = x.shape
    xq = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        _kernel()[(m,)](x, xq, scale, k, EPS, INV_FP8_MAX, FP8_MAX, BLOCK=1024, **pdl_args(), num_warps=4)
    return xq, scale


def _check(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor) -> None:
    assert q.dtype == FP8 and q.dim() == 2, f"q must be float8_e4m3fn [N, K], got {q.dtype} {tuple(q.shape)}"
    assert x.shape[-1] == q.shape[1], f"x [..., {x.shape[-1]}] vs q [N, {q.shape[1]}]"
    assert w_scale.shape == (q.shape[0],) and w_scale.dtype == torch.float32, "w_scale must be fp32 [N]"


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def quantize_per_token_kernel(x_ptr, q_ptr, s_ptr, K: tl.constexpr, eps, inv_fp8_max, fp8_max,
                                  BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            c = start + cols
            x = tl.load(x_ptr + row * K + c, mask=c < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), eps) * inv_fp8_max  # one fp32 product, as the reference
        tl.store(s_ptr + row, scale)
        for start in range(0, K, BLOCK):
            c = start + cols
            x = tl.load(x_ptr + row * K + c, mask=c < K, other=0.0).to(tl.float32)
            y = tl.clamp(tl.math.div_rn(x, scale), -fp8_max, fp8_max)  # IEEE division, as torch's tensor / tensor
            tl.store(q_ptr + row * K + c, y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=c < K)

    return quantize_per_token_kernel
