"""Fused residual add + RMSNorm, with a per-row choice between stacked norm weights.

    residual += delta                (fp32 residual stream, updated in place; delta may be None)
    out = (residual * rsqrt(mean(residual^2) + eps) * weight[select[row]]).to(out_dtype)

The residual stream is kept in fp32 and the normalized row is scaled in fp32 before one cast, so
the bf16 fast path stays close to an fp32 reference. `weight` is [W, H]: W = 1 for a plain norm,
W = 2 for a DualFFN pair (row 0 text, row 1 audio) chosen per row by `select` [N] (0/1).

`add_rms_norm_ref` is the plain-torch definition (any device); `add_rms_norm` is the Triton kernel
(CUDA only, one program per row). `add_rms_norm_fp8` is the same kernel writing the normalized bf16 row
already quantized per token for an fp8 linear (`fp8_linear.Fp8Rows`): the row rounded to bf16 as
`add_rms_norm` writes it, then quantized as `fp8_linear.quantize_per_token` quantizes it, so the linear's
own quantization launch and a bf16 round trip through memory go.
"""

from __future__ import annotations

import functools

import torch

from higgs_stream.kernels._triton import pdl_args, require_cuda, triton_modules
from higgs_stream.kernels.fp8_linear import EPS, FP8, FP8_MAX, INV_FP8_MAX, Fp8Rows


def _check(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
           select: torch.Tensor | None) -> None:
    assert residual.dim() == 2 and residual.dtype == torch.float32, f"residual must be fp32 [N, H], got {residual.dtype} {tuple(residual.shape)}"
    assert weight.dim() == 2 and weight.shape[1] == residual.shape[1], f"weight [W, H] vs residual {tuple(residual.shape)}"
    assert delta is None or delta.shape == residual.shape, f"delta {tuple(delta.shape)} vs residual {tuple(residual.shape)}"
    assert select is None or select.shape == (residual.shape[0],), "select must be [N]"
    assert select is not None or weight.shape[0] == 1, "stacked weights need a per-row select"


def add_rms_norm_ref(
    delta: torch.Tensor | None,  # [N, H] any float dtype, or None
    residual: torch.Tensor,  # [N, H] fp32, updated in place
    weight: torch.Tensor,  # [W, H]
    eps: float,
    select: torch.Tensor | None = None,  # [N] int, row of `weight` per token
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """-> [N, H] out_dtype (see module docstring)."""
    _check(delta, residual, weight, select)
    if delta is not None:
        residual.add_(delta.float())
    inv_rms = torch.rsqrt(residual.pow(2).mean(dim=-1, keepdim=True) + eps)  # [N, 1]
    w = weight[0][None] if select is None else weight[select.long()]  # [1 or N, H]
    return (residual * inv_rms * w.float()).to(out_dtype)


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def add_rms_norm_kernel(delta_ptr, res_ptr, w_ptr, sel_ptr, out_ptr, scale_ptr, H, eps, q_eps, inv_fp8_max,
                            fp8_max, HAS_DELTA: tl.constexpr, HAS_SELECT: tl.constexpr, QUANT: tl.constexpr,
                            BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            r += tl.load(delta_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(res_ptr + row * H + cols, r, mask=mask)
        inv_rms = tl.rsqrt(tl.sum(r * r, axis=0) / H + eps)
        w_row = 0
        if HAS_SELECT:
            w_row = tl.load(sel_ptr + row).to(tl.int64)
        w = tl.load(w_ptr + w_row * H + cols, mask=mask, other=0.0).to(tl.float32)
        y = r * inv_rms * w
        if QUANT:  # the bf16 row, quantized per token (fp8_linear's quantize_per_token_kernel, same operations)
            y = y.to(tl.bfloat16).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(y), axis=0), q_eps) * inv_fp8_max
            tl.store(scale_ptr + row, scale)
            y = tl.clamp(tl.math.div_rn(y, scale), -fp8_max, fp8_max)
            tl.store(out_ptr + row * H + cols, y.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        else:
            tl.store(out_ptr + row * H + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return triton, add_rms_norm_kernel


def add_rms_norm(
    delta: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    select: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Triton version of `add_rms_norm_ref` (CUDA tensors, contiguous rows)."""
    out = torch.empty(residual.shape, dtype=out_dtype, device=residual.device)
    _launch(delta, residual, weight, eps, select, out, None)
    return out


def add_rms_norm_fp8(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     select: torch.Tensor | None = None) -> Fp8Rows:
    """`add_rms_norm` to bf16, then `fp8_linear.quantize_per_token`, in one kernel (CUDA): the same values."""
    out = torch.empty(residual.shape, dtype=FP8, device=residual.device)
    scale = torch.empty(residual.shape[:1], dtype=torch.float32, device=residual.device)
    _launch(delta, residual, weight, eps, select, out, scale)
    return Fp8Rows(out, scale)


def _launch(delta, residual, weight, eps, select, out, scale) -> None:
    _check(delta, residual, weight, select)
    require_cuda(delta, residual, weight, select, what="add_rms_norm")
    assert residual.is_contiguous() and (delta is None or delta.is_contiguous()) and weight.is_contiguous()
    assert select is None or select.is_contiguous(), "select: read by element offsets"
    launch(_kernel(), delta, residual, weight, eps, select, out, scale)


def launch(compiled, delta, residual, weight, eps, select, out, scale) -> None:
    """The launch itself (no device check: Triton's interpreter runs it on CPU tensors in the tests); `scale`
    None: a plain norm into `out`, else quantized per token into `out` and `scale`."""
    triton, kernel = compiled
    n, h = residual.shape
    if n == 0:
        return
    block = triton.next_power_of_2(h)
    kernel[(n,)](delta if delta is not None else residual, residual, weight,
                 select if select is not None else residual, out, scale if scale is not None else residual, h, eps,
                 EPS, INV_FP8_MAX, FP8_MAX, HAS_DELTA=delta is not None, HAS_SELECT=select is not None,
                 QUANT=scale is not None, BLOCK=block, **pdl_args(), num_warps=8 if block >= 2048 else 4)
