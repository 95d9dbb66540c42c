"""RMSNorm (Llama style): statistics in fp32, scale applied after casting back to the input dtype."""

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] in x's dtype (weight's dtype when it is wider)."""
    assert x.shape[-1] == weight.shape[0], f"rms_norm: hidden {x.shape[-1]} != weight {weight.shape[0]}"
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * (x32 * inv_rms).to(x.dtype)
