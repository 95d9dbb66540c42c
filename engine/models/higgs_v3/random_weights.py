"""Higgs Audio v3 with seeded random weights, drawn in memory (benchmarks, `random:*`). Noise, never speech."""

from __future__ import annotations

from typing import Any

import torch

from higgs_stream.engine.checkpoint_files import parameters_on_meta
from higgs_stream.engine.models.higgs_v3.config import TalkerV3Config, V3SpecialTokens
from higgs_stream.engine.models.higgs_v3.make_checkpoint import build_v3_tokenizer, preset_v3
from higgs_stream.engine.models.higgs_v3.talker import TalkerV3
from higgs_stream.engine.tokenizer import TextTokenizer


@torch.no_grad()
def random_talker(preset: str, device: Any, dtype: torch.dtype, max_positions: int,
                  seed: int) -> tuple[TalkerV3, TalkerV3Config, TextTokenizer]:
    """The v3 talker (Qwen3) drawn on the device as make_checkpoint.py draws it: matrices and
    embeddings N(0, std^2), norms 1 + N(0, 0.1^2); backbone and fused audio matrix in `dtype`."""
    p = preset_v3(preset)
    tokenizer = TextTokenizer(build_v3_tokenizer(p.bpe_vocab, p.added), specials=V3SpecialTokens)
    cfg = p.config.with_special(tokenizer.special)
    with parameters_on_meta():
        talker = TalkerV3(cfg, max_positions=max_positions)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, meta in sorted(talker.state_dict().items()):  # parameters only: the buffers are not persistent
        noise = torch.randn(meta.shape, generator=gen, device=device, dtype=torch.float32)
        tensors[name] = (1.0 + 0.1 * noise if name.endswith("norm.weight") else p.init_std * noise).to(dtype)
        del noise
    result = talker.load_state_dict(tensors, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys, f"TalkerV3 keys: {result}"
    talker.to(device)  # buffers (RoPE inverse frequencies, codebook offsets)
    talker.requires_grad_(False)
    return talker.eval(), cfg, tokenizer
