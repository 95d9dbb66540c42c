"""Snake activations of the codec decoders, one read and one write of [B, C, T] (Triton, CUDA, fp32).

- `snake` (the Higgs codec): x + sin²(αx) / (α + 1e-9), one α per channel; `snake_ref` its plain-torch
  definition (five elementwise passes).
- `snake_beta` (the Qwen3-TTS 12 Hz decoder's SnakeBeta, parameters stored as logs):
  x + sin²(x e^a) / (e^b + 1e-9); `snake_beta_ref` its plain-torch definition (seven passes, and
  the two exponentials of the per-channel parameters on every call).

One kernel serves both (`BETA` picks where the frequency and the amplitude come from). The decoders
run it on every upsampling stage at up to 24 kHz, where the plain passes were about 30 % of decode
time, and dozens of times per step at a stream's first frame, where each pass is a launch.
Elementwise, so the result of a sample never depends on the window it is decoded in (streamed ==
one-shot is unaffected).
"""

from __future__ import annotations

import functools

import torch

from higgs_stream.kernels._triton import require_cuda, triton_modules


def snake_ref(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """x [B, C, T], alpha [1, C, 1] -> [B, C, T]."""
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def snake_beta_ref(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> torch.Tensor:
    """x [B, C, T], log_alpha / log_beta [C] -> [B, C, T]."""
    a = log_alpha.exp()[None, :, None]
    b = log_beta.exp()[None, :, None]
    return x + (1.0 / (b + 1e-9)) * torch.sin(x * a).pow(2)


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def snake_kernel(x_ptr, p_ptr, q_ptr, out_ptr, channels, length, BLOCK: tl.constexpr, BETA: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # b * C + c
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < length
        if BETA:  # frequency e^p, amplitude 1 / (e^q + 1e-9)
            a = tl.exp(tl.load(p_ptr + row % channels))
            inv = 1.0 / (tl.exp(tl.load(q_ptr + row % channels)) + 1e-9)
        else:  # frequency alpha = p, amplitude 1 / (alpha + 1e-9)
            a = tl.load(p_ptr + row % channels)
            inv = 1.0 / (a + 1e-9)
        x = tl.load(x_ptr + row * length + cols, mask=mask, other=0.0)
        s = tl.sin(a * x)
        tl.store(out_ptr + row * length + cols, x + inv * (s * s), mask=mask)

    return triton, snake_kernel


def _launch(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, what: str) -> torch.Tensor:
    require_cuda(x, p, what=what)
    assert x.dim() == 3 and x.dtype == torch.float32, f"x must be fp32 [B, C, T], got {x.dtype} {tuple(x.shape)}"
    for v in (p, q):
        assert v is None or v.numel() == x.shape[1], f"one parameter per channel: {v.numel()} vs {x.shape[1]}"
    x = x.contiguous()
    p = p.reshape(-1).contiguous().float()
    out = torch.empty_like(x)
    b, c, t = x.shape
    if x.numel():
        triton, kernel = _kernel()
        block = 1024 if t > 256 else 256
        beta = q is not None
        kernel[(b * c, triton.cdiv(t, block))](x, p, q.reshape(-1).contiguous().float() if beta else p, out, c, t,
                                               BLOCK=block, BETA=beta, num_warps=4 if block == 1024 else 2)
    return out


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Triton version of `snake_ref` (fp32, CUDA)."""
    return _launch(x, alpha, None, "snake")


def snake_beta(x: torch.Tensor, log_alpha: torch.Tensor, log_beta: torch.Tensor) -> torch.Tensor:
    """Triton version of `snake_beta_ref` (fp32, CUDA)."""
    require_cuda(log_beta, what="snake_beta")
    return _launch(x, log_alpha, log_beta, "snake_beta")
