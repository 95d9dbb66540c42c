"""The Higgs codec decoder's narrow layers fused (Triton, CUDA, fp32): each stage one read of its input, one write.

At 8 and 24 kHz the decoder runs 64 and 32 channels, where cuDNN's fp32 convolutions reach 15-21 TFLOP/s on an H200
and a residual unit is five passes over [B, C, T] (Snake, the dilated conv, Snake, the pointwise conv, the skip's
add); the last layer (Snake, then a k7 conv to one channel) ran at 0.75 TFLOP/s (docs/PERF.md, session 28).

- `residual_unit(buf, ...)`: y = buf[:, :, skip : skip + n] + W2 · snake(b1 + Σ_k W1_k · snake(buf[:, :, k·d : k·d + n]))
  + b2 for an unpadded input buffer `buf` [B, C, n + (K - 1)·d], the whole unit in one kernel: a program holds a
  block of positions for every channel, the dilated conv's K taps and the pointwise conv as matrix products over
  the channels (`tl.dot`), nothing written between them.
- `snake_conv_out(buf, ...)`: y = b + Σ_{c,k} w[c, k] · snake(buf[:, c, k·d + t]), a conv to one channel.

`residual_unit_ref` / `snake_conv_out_ref` are the plain-torch definitions (F.conv1d without padding). The products
run in IEEE fp32 by default (`precision="ieee"`: FMA, no tensor cores), so the results equal cuDNN's fp32 to fp32
rounding (the summation order differs); "tf32" is the opt-in TF32 codec's. Snake is x + sin²(αx) / (α + 1e-9), one
α per channel (kernels/snake.py). Channels up to 128 (`MAX_CHANNELS`); a count that is not a power of two runs
padded to one (masked).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from higgs_stream.kernels._triton import require_cuda, triton_modules
from higgs_stream.kernels.snake import snake_ref

MAX_CHANNELS = 128
PRECISIONS = ("ieee", "tf32", "tf32x3")  # tf32x3: three TF32 products a product (measured, not served)


def _positions(buf: torch.Tensor, taps: int, dilation: int) -> int:
    n = buf.shape[2] - (taps - 1) * dilation
    assert n >= 0, f"buffer of {buf.shape[2]} samples is shorter than the conv's span {(taps - 1) * dilation + 1}"
    return n


def residual_unit_ref(buf: torch.Tensor, alpha1: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, dilation: int,
                      alpha2: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, skip: int | None = None) -> torch.Tensor:
    """buf [B, C, n + (K-1)d]; w1 [C, C, K], w2 [C, C, 1], alphas [1, C, 1] (or [C]); skip: where the skip reads
    (default the span's centre, (K-1)d/2) -> [B, C, n]."""
    taps = w1.shape[2]
    n = _positions(buf, taps, dilation)
    skip = (taps - 1) * dilation // 2 if skip is None else skip
    h = F.conv1d(snake_ref(buf, alpha1.reshape(1, -1, 1)), w1, b1, dilation=dilation)
    g = F.conv1d(snake_ref(h, alpha2.reshape(1, -1, 1)), w2, b2)
    return buf[:, :, skip:skip + n] + g


def snake_conv_out_ref(buf: torch.Tensor, alpha: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                       dilation: int = 1) -> torch.Tensor:
    """buf [B, C, n + (K-1)d]; w [1, C, K] -> [B, 1, n]."""
    return F.conv1d(snake_ref(buf, alpha.reshape(1, -1, 1)), w, b, dilation=dilation)


def _padded(c: int) -> int:
    return max(16, 1 << (c - 1).bit_length())  # tl.dot wants power-of-two sides of at least 16


@functools.cache
def _kernels():
    triton, tl = triton_modules()

    @triton.jit
    def residual_kernel(buf_ptr, a1_ptr, w1_ptr, b1_ptr, a2_ptr, w2_ptr, b2_ptr, out_ptr, n, channels,
                        buf_row, buf_ch, out_row, out_ch, DIL: tl.constexpr, TAPS: tl.constexpr,
                        SKIP: tl.constexpr, CP: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        ch = tl.arange(0, CP)
        cmask = ch < channels
        tmask = t < n
        xmask = cmask[:, None] & tmask[None, :]
        wmask = cmask[:, None] & cmask[None, :]
        a1 = tl.load(a1_ptr + ch, mask=cmask, other=1.0)
        inv1 = 1.0 / (a1 + 1e-9)
        src = buf_ptr + row * buf_row + ch[:, None] * buf_ch + t[None, :]
        wk = w1_ptr + ch[:, None] * channels + ch[None, :]  # w1 laid out [K, Cout, Cin]
        acc = tl.zeros((CP, BT), dtype=tl.float32)
        for k in tl.static_range(TAPS):
            x = tl.load(src + k * DIL, mask=xmask, other=0.0)
            s = tl.sin(a1[:, None] * x)
            x += inv1[:, None] * (s * s)  # Snake (a closure's helper is invisible to Triton: written out)
            w = tl.load(wk + k * channels * channels, mask=wmask, other=0.0)
            acc = tl.dot(w, x, acc, input_precision=PRECISION)
        acc += tl.load(b1_ptr + ch, mask=cmask, other=0.0)[:, None]
        a2 = tl.load(a2_ptr + ch, mask=cmask, other=1.0)
        s = tl.sin(a2[:, None] * acc)
        h = acc + (1.0 / (a2 + 1e-9))[:, None] * (s * s)
        w2 = tl.load(w2_ptr + ch[:, None] * channels + ch[None, :], mask=wmask, other=0.0)
        y = tl.dot(w2, h, input_precision=PRECISION) + tl.load(b2_ptr + ch, mask=cmask, other=0.0)[:, None]
        y += tl.load(src + SKIP, mask=xmask, other=0.0)
        tl.store(out_ptr + row * out_row + ch[:, None] * out_ch + t[None, :], y, mask=xmask)

    @triton.jit
    def conv_out_kernel(buf_ptr, a_ptr, w_ptr, bias, out_ptr, n, channels, buf_row, buf_ch, out_row,
                        DIL: tl.constexpr, TAPS: tl.constexpr, CP: tl.constexpr, BT: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        ch = tl.arange(0, CP)
        cmask = ch < channels
        tmask = t < n
        xmask = cmask[:, None] & tmask[None, :]
        a = tl.load(a_ptr + ch, mask=cmask, other=1.0)
        inv = 1.0 / (a + 1e-9)
        src = buf_ptr + row * buf_row + ch[:, None] * buf_ch + t[None, :]
        acc = tl.zeros((CP, BT), dtype=tl.float32)
        for k in tl.static_range(TAPS):
            x = tl.load(src + k * DIL, mask=xmask, other=0.0)
            s = tl.sin(a[:, None] * x)
            x += inv[:, None] * (s * s)
            acc += tl.load(w_ptr + k * channels + ch, mask=cmask, other=0.0)[:, None] * x  # w laid out [K, C]
        tl.store(out_ptr + row * out_row + t, tl.sum(acc, axis=0) + bias, mask=tmask)

    return triton, residual_kernel, conv_out_kernel


def _check(buf: torch.Tensor, channels: int, what: str) -> None:
    assert buf.dim() == 3 and buf.dtype == torch.float32 and buf.stride(2) == 1, \
        f"{what}: buf must be fp32 [B, C, T] with unit time stride, got {buf.dtype} {tuple(buf.shape)} {buf.stride()}"
    assert buf.shape[1] == channels, f"{what}: {buf.shape[1]} input channels, the weights take {channels}"
    assert channels <= MAX_CHANNELS, f"{what}: at most {MAX_CHANNELS} channels, got {channels}"


class ResidualUnitWeights:
    """A residual unit's parameters laid out for the kernel (once, at load): w1 as [K, Cout, Cin], w2 [C, C], the
    alphas and biases flat. Built from the module's fp32 tensors; copies, so the module's own stay as they are."""

    def __init__(self, alpha1: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, dilation: int, alpha2: torch.Tensor,
                 w2: torch.Tensor, b2: torch.Tensor, skip: int | None = None):
        c, cin, taps = w1.shape
        assert c == cin and w2.shape == (c, c, 1), f"a residual unit maps C -> C: w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}"
        self.channels, self.taps, self.dilation = c, taps, int(dilation)
        self.skip = (taps - 1) * self.dilation // 2 if skip is None else int(skip)
        self.alpha1 = alpha1.detach().reshape(-1).float().contiguous()
        self.alpha2 = alpha2.detach().reshape(-1).float().contiguous()
        self.w1 = w1.detach().float().permute(2, 0, 1).contiguous()
        self.w2 = w2.detach().float().reshape(c, c).contiguous()
        self.b1 = b1.detach().float().contiguous()
        self.b2 = b2.detach().float().contiguous()


def residual_unit(buf: torch.Tensor, wts: ResidualUnitWeights, out: torch.Tensor | None = None,
                  precision: str = "ieee", block_t: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """The fused residual unit (see the module docstring): buf [B, C, n + (K-1)d] -> [B, C, n], written into `out`
    when given (any [B, C, n] view with unit time stride, e.g. the next layer's input buffer)."""
    require_cuda(buf, wts.w1, what="residual_unit")
    return launch_residual_unit(buf, wts, out, precision, block_t, num_warps)


def launch_residual_unit(buf: torch.Tensor, wts: ResidualUnitWeights, out: torch.Tensor | None = None,
                         precision: str = "ieee", block_t: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """`residual_unit` on any device Triton runs on (its interpreter on the CPU: the tests)."""
    _check(buf, wts.channels, "residual_unit")
    assert precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {precision!r}"
    b, c, _ = buf.shape
    n = _positions(buf, wts.taps, wts.dilation)
    if out is None:
        out = torch.empty((b, c, n), dtype=torch.float32, device=buf.device)
    assert out.shape == (b, c, n) and out.stride(2) == 1, f"out must be [{b}, {c}, {n}], got {tuple(out.shape)}"
    if b and n:
        triton, kernel, _ = _kernels()
        cp = _padded(c)
        bt = block_t or (128 if cp <= 32 else 64 if cp <= 64 else 32)
        kernel[(triton.cdiv(n, bt), b)](buf, wts.alpha1, wts.w1, wts.b1, wts.alpha2, wts.w2, wts.b2, out, n, c,
                                        buf.stride(0), buf.stride(1), out.stride(0), out.stride(1), DIL=wts.dilation,
                                        TAPS=wts.taps, SKIP=wts.skip, CP=cp, BT=bt, PRECISION=precision,
                                        num_warps=num_warps)
    return out


class ConvOutWeights:
    """A Snake + conv to one channel's parameters for the kernel: w [1, C, K] as [K, C], the bias as a float."""

    def __init__(self, alpha: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dilation: int = 1):
        cout, c, taps = w.shape
        assert cout == 1, f"snake_conv_out makes one channel, the weight makes {cout}"
        self.channels, self.taps, self.dilation = c, taps, int(dilation)
        self.alpha = alpha.detach().reshape(-1).float().contiguous()
        self.w = w.detach().float()[0].t().contiguous()
        self.bias = 0.0 if b is None else float(b.detach().float().reshape(-1)[0])


def snake_conv_out(buf: torch.Tensor, wts: ConvOutWeights, block_t: int = 256) -> torch.Tensor:
    """Snake, then the conv to one channel: buf [B, C, n + (K-1)d] -> [B, 1, n]."""
    require_cuda(buf, wts.w, what="snake_conv_out")
    return launch_conv_out(buf, wts, block_t)


def launch_conv_out(buf: torch.Tensor, wts: ConvOutWeights, block_t: int = 256) -> torch.Tensor:
    """`snake_conv_out` on any device Triton runs on (its interpreter on the CPU: the tests)."""
    _check(buf, wts.channels, "snake_conv_out")
    b, c, _ = buf.shape
    n = _positions(buf, wts.taps, wts.dilation)
    out = torch.empty((b, 1, n), dtype=torch.float32, device=buf.device)
    if b and n:
        triton, _, kernel = _kernels()
        cp = _padded(c)
        bt = min(block_t, 8192 // cp)  # the [C, BT] partial sums: at most 64 registers a thread
        kernel[(triton.cdiv(n, bt), b)](buf, wts.alpha, wts.w, wts.bias, out, n, c, buf.stride(0), buf.stride(1),
                                        out.stride(0), DIL=wts.dilation, TAPS=wts.taps, CP=cp, BT=bt, num_warps=4)
    return out
