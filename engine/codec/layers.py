"""Building blocks shared by the DAC-style acoustic encoder and decoder.

Module and parameter names follow the transformers-native checkpoint (`snake1`, `conv1`, ...), so a
state dict in that layout loads with no renaming. Convolutions are plain: weight norm is folded at load.
"""

from __future__ import annotations

import torch
from torch import nn

from higgs_stream.kernels.snake import snake, snake_ref


class Snake1d(nn.Module):
    """Snake activation x + sin²(αx)/(α + 1e-9), one learned α per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C, T]
        if x.is_cuda and x.dtype == torch.float32:
            return snake(x, self.alpha)  # one fused pass (Triton); CPU keeps the plain-torch definition
        return snake_ref(x, self.alpha)


class ResidualUnit(nn.Module):
    """Snake -> k7 dilated conv -> Snake -> k1 conv, plus the input. Length-preserving ("same" padding)."""

    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.snake1 = Snake1d(channels)
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake1d(channels)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C, T]
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w = g · v / ‖v‖, the norm taken over every dim where g has size 1.

    That rule covers both conventions met in these checkpoints without being told which: DAC convs use
    dim 0 (g [C0, 1, 1]; for ConvTranspose1d dim 0 is the INPUT channel), HuBERT's positional conv uses
    dim 2 (g [1, 1, K]).
    """
    assert g.dim() == v.dim(), f"weight_g {tuple(g.shape)} and weight_v {tuple(v.shape)} differ in rank"
    assert all(gs in (1, vs) for gs, vs in zip(g.shape, v.shape)), \
        f"weight_g {tuple(g.shape)} does not broadcast against weight_v {tuple(v.shape)}"
    dims = [d for d in range(v.dim()) if g.shape[d] == 1]
    v32, g32 = v.float(), g.float()
    norm = torch.linalg.vector_norm(v32, dim=dims, keepdim=True) if dims else v32.abs()
    return (v32 * (g32 / norm)).to(v.dtype)  # associated like torch._weight_norm


def unfold_weight_norm(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of fold_weight_norm for dim 0: (g = ‖w‖ per dim-0 slice, v = w)."""
    g = torch.linalg.vector_norm(w, dim=list(range(1, w.dim())), keepdim=True)
    return g, w.clone()
