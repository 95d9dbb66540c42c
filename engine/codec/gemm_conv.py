"""Convolutions over a few output positions as one matrix product (the streaming decoders' first frames).

A stateful decoder step at one stream's first frame runs every convolution of the stack over a handful
of positions (the Qwen3-TTS 12 Hz decoder: 4 at its first layer, 32 after the first upsampling) with
up to 1536 channels. cuDNN's implicit-GEMM kernels then take ~65 us a layer on an H100 (measured:
23 such calls were 1.5 ms of a 4.5 ms step), where reading the weights would take a few. Written as
im2col + one GEMM (cuBLAS's small-M kernels read the weight once), the same sums run at about the
weight-read time. Larger steps keep cuDNN (`GEMM_ROWS`), whose kernels win once there are many
positions. Both compute the same products in fp32; only the summation order differs (fp32 rounding).

The Higgs stateful decoder also runs its first conv (256 -> 1024 channels, k7, 25 Hz) through `conv1d_gemm` at every
size (engine/codec/streaming.gemm_stage: 0.41 vs 3.61 ms on cuDNN at 128 streams x 25 frames, H200, session 29).

`conv1d` / `conv_transpose1d` pick the path; `*_gemm` always take the GEMM one (the tests compare the two).
The GEMM follows `torch.backends.cuda.matmul.allow_tf32` (off by default), so a codec in its TF32 mode (a
cuDNN setting) keeps these small layers in full fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GEMM_ROWS = 256  # on CUDA, a convolution with at most this many output rows (batch x positions) runs as a GEMM


def conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1,
           groups: int = 1) -> torch.Tensor:
    """F.conv1d without padding: x [B, Cin, L] -> [B, Cout, L - (k - 1) * dilation]."""
    b, _, length = x.shape
    rows = b * (length - (weight.shape[2] - 1) * dilation)
    if groups == 1 and x.is_cuda and 0 < rows <= GEMM_ROWS:
        return conv1d_gemm(x, weight, bias, dilation)
    return F.conv1d(x, weight, bias, dilation=dilation, groups=groups)


def conv1d_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1) -> torch.Tensor:
    b, cin, _ = x.shape
    cout, _, k = weight.shape
    cols = x.unfold(2, (k - 1) * dilation + 1, 1)[..., ::dilation]  # [B, Cin, n, k]
    n = cols.shape[2]
    cols = cols.permute(0, 2, 1, 3).reshape(b * n, cin * k)
    w = weight.reshape(cout, cin * k).t()
    y = cols @ w if bias is None else torch.addmm(bias, cols, w)  # [B * n, Cout]
    return y.view(b, n, cout).transpose(1, 2)


def conv_transpose1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int) -> torch.Tensor:
    """F.conv_transpose1d with kernel k = stride or 2 * stride: x [B, Cin, L] -> [B, Cout, (L - 1) * s + k]."""
    k = weight.shape[2]
    if x.is_cuda and k in (stride, 2 * stride) and 0 < x.shape[0] * x.shape[2] <= GEMM_ROWS:
        return conv_transpose1d_gemm(x, weight, bias, stride)
    return F.conv_transpose1d(x, weight, bias, stride=stride)


def conv_transpose1d_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          stride: int) -> torch.Tensor:
    """Each input position's GEMM row holds its k output samples per channel; with k = 2s the second half
    of position t overlaps the first half of t + 1 (one add)."""
    b, cin, length = x.shape
    _, cout, k = weight.shape
    s = stride
    assert k in (s, 2 * s), f"conv_transpose1d_gemm supports k = s or 2s, got k={k}, s={s}"
    y = (x.transpose(1, 2).reshape(b * length, cin) @ weight.reshape(cin, cout * k)).view(b, length, cout, k)
    if k == 2 * s:  # blocks of s samples: block t = first half of t + second half of t - 1, t in [0, L]
        zero = y.new_zeros(b, 1, cout, s)
        y = torch.cat([y[..., :s], zero], dim=1) + torch.cat([zero, y[..., s:]], dim=1)  # [B, L + 1, Cout, s]
    out = y.permute(0, 2, 1, 3).reshape(b, cout, -1)
    return out if bias is None else out + bias[None, :, None]
