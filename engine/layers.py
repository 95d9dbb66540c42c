"""Transformer layers every family's plain-torch talker builds from: RMSNorm, SwiGLU MLP, and GQA
self-attention over the paged KV cache (`project_qkv` is the hook a variant overrides, e.g. Qwen3's
QK-norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from higgs_stream.engine.talker_config import BackboneConfig
from higgs_stream.kernels.attention import PagedLayout, paged_attention_ref, write_paged_kv_ref
from higgs_stream.kernels.norm import rms_norm_ref
from higgs_stream.kernels.rope import apply_rope_ref


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases."""

    LINEARS = ("gate_proj", "up_proj", "down_proj")  # what `--quantize` may quantize (engine/quantize.py)

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA self-attention that writes this step's K/V into the page pool, then reads it back paged.

    `project_qkv` is the hook a variant overrides to transform q/k/v before RoPE (Qwen3: QK-norm).
    """

    LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")  # what `--quantize` may quantize (engine/quantize.py)

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, H] -> q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D] (before RoPE)."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,  # [N, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [N, D]
        k_pool: torch.Tensor,  # [P, page_size, Hkv, D] (this layer)
        v_pool: torch.Tensor,
        layout: PagedLayout,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.project_qkv(x)  # [N, Hq, D], [N, Hkv, D], [N, Hkv, D]
        q, k = apply_rope_ref(q, *rope), apply_rope_ref(k, *rope)
        write_paged_kv_ref(k_pool, v_pool, k, v, layout.slot_mapping)
        out = paged_attention_ref(q, k_pool, v_pool, layout, sm_scale=self.head_dim**-0.5)  # [N, Hq, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))  # [N, H]
