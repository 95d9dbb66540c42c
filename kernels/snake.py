"""Snake activation of the codec decoder: x + sin²(αx) / (α + 1e-9), one α per channel.

`snake_ref` is the plain-torch definition (five elementwise passes over [B, C, T]); `snake` the
Triton kernel (CUDA, fp32): one read and one write. The decoder runs it on every upsampling stage at
up to 24 kHz, where these passes were about 30 % of decode time. Elementwise, so the result of a
sample never depends on the window it is decoded in (streamed == one-shot is unaffected).
"""

from __future__ import annotations

import functools

import torch

from higgs_stream.kernels._triton import require_cuda, triton_modules


def snake_ref(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """x [B, C, T], alpha [1, C, 1] -> [B, C, T]."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def snake_kernel(x_ptr, alpha_ptr, out_ptr, channels, length, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # b * C + c
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < length
        a = tl.load(alpha_ptr + row % channels)
        inv = 1.0 / (a + 1e-9)
        x = tl.load(x_ptr + row * length + cols, mask=mask, other=0.0)
        s = tl.sin(a * x)
        tl.store(out_ptr + row * length + cols, x + inv * (s * s), mask=mask)

    return triton, snake_kernel


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Triton version of `snake_ref` (fp32, CUDA)."""
    require_cuda(x, alpha, what="snake")
    assert x.dim() == 3 and x.dtype == torch.float32, f"x must be fp32 [B, C, T], got {x.dtype} {tuple(x.shape)}"
    assert alpha.numel() == x.shape[1], f"one alpha per channel: {alpha.numel()} vs {x.shape[1]}"
    x = x.contiguous()
    a = alpha.reshape(-1).contiguous().float()
    out = torch.empty_like(x)
    b, c, t = x.shape
    if x.numel():
        triton, kernel = _kernel()
        block = 1024
        kernel[(b * c, triton.cdiv(t, block))](x, a, out, c, t, BLOCK=block, num_warps=4)
    return out
