"""SwiGLU activation on a fused gate/up projection: [N, 2I] -> silu(gate) * up [N, I].

`silu_and_mul_ref` is the plain-torch definition (fp32 math, one cast); `silu_and_mul` the Triton
kernel (CUDA only). `silu_and_mul_fp8` writes the bf16 result already quantized per token for an fp8
linear (`fp8_linear.Fp8Rows`): one program per row holding the whole row (as `fused_norm`'s quantizing norm
does), computing silu(gate) * up as `silu_and_mul` does and rounding it to bf16 before `quantize_per_token`'s
operations (the row's amax, then the values), so the values equal the unfused pair's.
"""

from __future__ import annotations

import functools

import torch

from higgs_stream.kernels._triton import pdl_args, require_cuda, triton_modules
from higgs_stream.kernels.fp8_linear import EPS, FP8, FP8_MAX, INV_FP8_MAX, Fp8Rows


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate first) -> [N, I] in gate_up's dtype."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, f"gate_up must be [N, 2I], got {tuple(gate_up.shape)}"
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    return triton, silu_and_mul_kernel


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of `silu_and_mul_ref`."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, f"gate_up must be [N, 2I], got {tuple(gate_up.shape)}"
    require_cuda(gate_up, what="silu_and_mul")
    assert gate_up.is_contiguous(), "gate_up must be contiguous"
    triton, kernel = _kernel()
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = 1024
        kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, **pdl_args(), num_warps=4)
    return out


@functools.cache
def _quant_kernel():
    triton, tl = triton_modules()

    @triton.jit
    def silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, inter, q_eps, inv_fp8_max, fp8_max, BLOCK: tl.constexpr,
                                PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)  # BLOCK >= inter: the whole row, read once
        mask = cols < inter
        gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(tl.bfloat16).to(tl.float32)  # 0 in the padding
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), q_eps) * inv_fp8_max
        tl.store(s_ptr + row, scale)
        y = tl.clamp(tl.math.div_rn(y, scale), -fp8_max, fp8_max)
        tl.store(q_ptr + row * inter + cols, y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    return silu_and_mul_fp8_kernel


def silu_and_mul_fp8(gate_up: torch.Tensor) -> Fp8Rows:
    """`silu_and_mul` to bf16, then `fp8_linear.quantize_per_token`, in one kernel (CUDA; gate_up bf16)."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, f"gate_up must be [N, 2I], got {tuple(gate_up.shape)}"
    require_cuda(gate_up, what="silu_and_mul_fp8")
    assert gate_up.is_contiguous() and gate_up.dtype == torch.bfloat16, "gate_up must be contiguous bf16"
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = Fp8Rows(torch.empty((n, inter), dtype=FP8, device=gate_up.device),
                  torch.empty((n,), dtype=torch.float32, device=gate_up.device))
    launch_fp8(_quant_kernel(), gate_up, out.q, out.scale)
    return out


def launch_fp8(kernel, gate_up: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """The launch itself (no device check: Triton's interpreter runs it on CPU tensors in the tests)."""
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if n:
        block = 1 << max(0, inter - 1).bit_length()  # the row's width, to a power of two
        kernel[(n,)](gate_up, q, scale, inter, EPS, INV_FP8_MAX, FP8_MAX, BLOCK=block,
                     **pdl_args(), num_warps=16 if block >= 16384 else 8 if block >= 2048 else 4)
