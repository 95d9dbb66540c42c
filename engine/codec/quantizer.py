"""Residual vector quantizer: 8 Euclidean codebooks of 1024 x 64, each with project_in / project_out.

Decode: quantized = Σ_k project_out_k(embed_k[codes_k]).
Encode: per stage, nearest codebook row (Euclidean) of project_in_k(residual), residual -= decode of it.
Names follow the transformers-native checkpoint: quantizers.{k}.codebook.embed, .project_in, .project_out.
`project_in` exists only when the codec is built for encoding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from higgs_stream.engine.codec.config import CodecConfig
from torch import nn


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("embed", torch.zeros(size, dim))  # [K, d]

    def nearest(self, x: torch.Tensor) -> torch.Tensor:  # [N, d] -> [N] long
        et = self.embed.t()  # [d, K]
        # ‖x‖² - 2x·e + ‖e‖², reduced and associated as in the reference so rounding (and ties) agree exactly.
        dist = x.pow(2).sum(1, keepdim=True) - 2 * x @ et + et.pow(2).sum(0, keepdim=True)
        return (-dist).max(dim=-1).indices


class VectorQuantizer(nn.Module):
    def __init__(self, cfg: CodecConfig, with_encoder: bool):
        super().__init__()
        self.codebook = Codebook(cfg.codebook_size, cfg.codebook_dim)
        self.project_in = nn.Linear(cfg.hidden_size, cfg.codebook_dim) if with_encoder else None
        self.project_out = nn.Linear(cfg.codebook_dim, cfg.hidden_size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # [B, F] -> [B, F, H]
        return self.project_out(F.embedding(codes, self.codebook.embed))

    def encode(self, residual: torch.Tensor) -> torch.Tensor:  # [B, F, H] -> [B, F]
        assert self.project_in is not None, "quantizer was built without project_in (decode-only codec)"
        x = self.project_in(residual)  # [B, F, d]
        return self.codebook.nearest(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, cfg: CodecConfig, with_encoder: bool):
        super().__init__()
        self.quantizers = nn.ModuleList(VectorQuantizer(cfg, with_encoder) for _ in range(cfg.num_quantizers))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # [B, Q, F] long -> [B, H, F]
        assert codes.dim() == 3 and codes.shape[1] == len(self.quantizers), \
            f"codes must be [B, {len(self.quantizers)}, F], got {tuple(codes.shape)}"
        out = self.quantizers[0].decode(codes[:, 0])
        for k in range(1, len(self.quantizers)):
            out = out + self.quantizers[k].decode(codes[:, k])
        return out.transpose(1, 2)

    def encode(self, latent: torch.Tensor) -> torch.Tensor:  # [B, H, F] -> [B, Q, F] long
        residual = latent.transpose(1, 2)  # [B, F, H]
        codes = []
        for q in self.quantizers:
            idx = q.encode(residual)
            residual = residual - q.decode(idx)
            codes.append(idx)
        return torch.stack(codes, dim=1)
