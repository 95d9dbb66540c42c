"""Higgs Audio v2 with seeded random weights, drawn in memory (benchmarks, parity runs, `random:*`).

transformers' reference `HiggsAudioV2ForConditionalGeneration` is built on the device in fp32 and
given seeded random weights the way `make-checkpoint` draws them (matrices and embeddings
N(0, 0.02^2), norms 1 + N(0, 0.1^2)) (`random_reference`); our `Talker` is built empty on the same
device and loads those tensors in the serving dtype (`talker_from_reference`). Same bytes and FLOPs
as the released model. The output is noise, never speech.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from higgs_stream.engine.models.higgs_v2.config import SpecialTokens, TalkerConfig
from higgs_stream.engine.models.higgs_v2.make_checkpoint import build_text_tokenizer, talker_config
from higgs_stream.engine.models.higgs_v2.talker import Talker
from higgs_stream.engine.tokenizer import TextTokenizer
from higgs_stream.kernels.rope import llama3_inv_freq

BPE_VOCAB = {"full": 128000, "tiny": 512}


@torch.no_grad()
def random_talker(preset: str, device: Any, dtype: torch.dtype, max_positions: int,
                  seed: int) -> tuple[Talker, TalkerConfig, TextTokenizer]:
    """The v2 talker with the weights `random_reference` draws (via transformers' reference, fp32 then `dtype`)."""
    tokenizer, cfg = tokenizer_and_config(preset)
    hf = random_reference(cfg, device, seed=seed)
    talker = talker_from_reference(hf, cfg, dtype)
    del hf
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    assert talker.max_positions >= max_positions, f"talker holds {talker.max_positions} positions < {max_positions}"
    return talker, cfg, tokenizer


def tokenizer_and_config(preset: str = "full", **dims: Any) -> tuple[TextTokenizer, TalkerConfig]:
    """A project tokenizer (byte-level BPE + the 256 Higgs special tokens) and its talker config."""
    cfg = talker_config(preset)
    if dims:
        cfg = replace(cfg, **dims)
    return TextTokenizer(build_text_tokenizer(BPE_VOCAB[preset]), specials=SpecialTokens), cfg


@torch.no_grad()
def random_reference(cfg: TalkerConfig, device: str | torch.device, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    """transformers' HiggsAudioV2ForConditionalGeneration (fp32, eval) with seeded random weights."""
    from transformers import HiggsAudioV2Config, HiggsAudioV2ForConditionalGeneration

    s = cfg.special
    hf_cfg = HiggsAudioV2Config(**cfg.to_hf_dict(), audio_delay_token_id=s.begin_of_text + 14)
    with torch.device(device):
        hf = HiggsAudioV2ForConditionalGeneration(hf_cfg).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    for _, p in sorted(hf.named_parameters()):
        if p.dim() == 1:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen, device=device))
    return hf


@torch.no_grad()
def talker_from_reference(hf: torch.nn.Module, cfg: TalkerConfig, dtype: torch.dtype) -> Talker:
    """Our Talker (no text head) on the reference's device, holding its weights in `dtype`."""
    device = next(hf.parameters()).device
    with torch.device("meta"):
        talker = Talker(cfg, use_text_head=False)
    talker = talker.to_empty(device=device).to(dtype)
    talker.load_state_dict(hf.state_dict(), strict=True)
    talker.inv_freq = llama3_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    talker.model.embed_audio_tokens.offsets.copy_(torch.arange(cfg.num_codebooks, device=device) * cfg.audio_vocab)
    return talker.eval()
