"""Higgs Audio v2 (`bosonai/higgs-audio-v2-generation-3B-base`): a Llama-3 talker whose every layer is
DualFFN, 8 codebooks under a delay pattern, the codec in its own repo (or MODEL/audio_tokenizer).

    config.py           TalkerConfig, SpecialTokens (both config.json layouts)
    checkpoint.py       the two on-disk layouts (transformers-native, Boson's original) and the loader
    talker.py           the plain-torch talker (and its fused weights for the fast path)
    prompt.py           REF's chat prompt
    policy.py           REF's per-stream state machine (AUDIO_INIT, RAS, ramps, frame cap)
    device_rules.py     the same rules on the device
    make_checkpoint.py  random-weight checkpoints in both layouts
    random_weights.py   random weights in memory (through transformers' reference)

`FAMILY` is the entry object the registry (models/registry.py) knows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from higgs_stream.engine.family import TokenizerLike
from higgs_stream.engine.models.higgs_v2.checkpoint import MODEL_TYPES, find_codec_dir, load_talker
from higgs_stream.engine.models.higgs_v2.config import TalkerConfig
from higgs_stream.engine.models.higgs_v2.device_rules import V2DeviceRules
from higgs_stream.engine.models.higgs_v2.policy import V2Policy


class HiggsV2:
    name = "higgs_v2"
    arch = "v2"
    summary = "Higgs Audio v2 (Llama-3 DualFFN, codec in OUT/audio_tokenizer)"
    model_types = tuple(MODEL_TYPES)
    config_type = TalkerConfig
    layouts = ("hf", "original")

    def load(self, root: Path, device: str | torch.device, dtype: torch.dtype | None,
             max_positions: int) -> tuple[torch.nn.Module, TalkerConfig, Any]:
        return load_talker(root, device=device, dtype=dtype, max_positions=max_positions)

    def load_codec(self, root: Path, codec: str | Path | None, device: str | torch.device) -> Any:
        """`codec` when given, else MODEL/audio_tokenizer, else the released codec on the hub."""
        from higgs_stream.engine import codec as codec_pkg  # looked up at call time (tests replace load_codec)

        return codec_pkg.load_codec(codec if codec is not None else find_codec_dir(root), device=device)

    def policy(self, cfg: TalkerConfig, tokenizer: TokenizerLike) -> V2Policy:
        return V2Policy(cfg, tokenizer)

    def device_rules(self, cfg: TalkerConfig) -> V2DeviceRules:
        return V2DeviceRules()

    def make_checkpoint(self, out: str | Path, preset: str, layout: str, seed: int) -> Path:
        from higgs_stream.engine.models.higgs_v2.make_checkpoint import make_checkpoint

        return make_checkpoint(out, preset=preset, layout=layout, seed=seed)

    def random_talker(self, preset: str, device: str | torch.device, dtype: torch.dtype, max_positions: int,
                      seed: int) -> tuple[torch.nn.Module, TalkerConfig, Any]:
        from higgs_stream.engine.models.higgs_v2.random_weights import random_talker

        return random_talker(preset, device, dtype, max_positions, seed)


FAMILY = HiggsV2()
