"""SwiGLU activation on a fused gate/up projection: [N, 2I] -> silu(gate) * up [N, I].

`silu_and_mul_ref` is the plain-torch definition (fp32 math, one cast); `silu_and_mul` the Triton
kernel (CUDA only).
"""

from __future__ import annotations

import functools

import torch

from higgs_stream.kernels._triton import require_cuda, triton_modules


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate first) -> [N, I] in gate_up's dtype."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, f"gate_up must be [N, 2I], got {tuple(gate_up.shape)}"
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
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
        kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4)
    return out
