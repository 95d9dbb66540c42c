"""Rotary position embedding with Llama-3 frequency scaling (half-split "rotate_half" layout)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def llama3_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32.

    With `scaling` (rope_type llama3): wavelengths longer than orig/low_freq_factor are divided by
    `factor`, shorter than orig/high_freq_factor are kept, and the band in between is interpolated
    with s = (orig/wavelength - low) / (high - low). Both the original Higgs parameters
    (orig 8192, low 1, high 4) and the transformers port's (orig 1024, low 1/8, high 1/2) describe
    the same curve.
    """
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    if scaling is None:
        return inv_freq
    assert scaling.get("rope_type", "llama3") == "llama3", f"unsupported rope scaling {scaling}"
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    orig = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    long_wave = wavelength > orig / low  # low frequencies: fully scaled
    short_wave = wavelength < orig / high  # high frequencies: untouched
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (orig / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~long_wave & ~short_wave, blended, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] long, inv_freq [D/2] -> (cos, sin) each [N, D] in `dtype` (angles in fp32)."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]  # [N, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [N, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D], cos/sin [N, D] -> [N, H, D]: pairs (i, i + D/2) rotated by angle pos * inv_freq[i]."""
    assert x.dim() == 3 and cos.shape == (x.shape[0], x.shape[2]), f"rope shapes {x.shape} vs {cos.shape}"
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + _rotate_half(x) * sin
