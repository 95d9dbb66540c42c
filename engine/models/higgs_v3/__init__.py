"""Higgs Audio v3 (`bosonai/higgs-audio-v3-tts-4b`): a Qwen3 talker with one tied fused audio matrix,
8 codebooks under a delay pattern (no BOS/EOS frames), the codec bundled in the checkpoint.

    config.py           TalkerV3Config, V3SpecialTokens
    checkpoint.py       the on-disk layout, its key table, the loader and the bundled codec
    talker.py           the plain-torch talker (and its fused weights for the fast path)
    prompt.py           the TTS prompt (sglang-omni / vllm-omni)
    policy.py           sglang-omni's per-stream row state machine (ramp-up, EOC countdown, frame cap)
    device_rules.py     the same rules on the device
    make_checkpoint.py  random-weight checkpoints in the real layout
    random_weights.py   random weights in memory

`FAMILY` is the entry object the registry (models/registry.py) knows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.family import TokenizerLike
from higgs_stream.engine.models.higgs_v3.checkpoint import load_codec_v3, load_talker_v3
from higgs_stream.engine.models.higgs_v3.config import MODEL_TYPE_V3, TalkerV3Config
from higgs_stream.engine.models.higgs_v3.device_rules import V3DeviceRules
from higgs_stream.engine.models.higgs_v3.policy import V3Policy


class HiggsV3:
    name = "higgs_v3"
    arch = "v3"
    summary = "Higgs Audio v3 (Qwen3, codec bundled in the weights)"
    model_types = (MODEL_TYPE_V3,)
    config_type = TalkerV3Config
    layouts = ("hf",)

    def load(self, root: Path, device: str | torch.device, dtype: torch.dtype | None,
             max_positions: int) -> tuple[torch.nn.Module, TalkerV3Config, Any]:
        return load_talker_v3(root, device=device, dtype=dtype, max_positions=max_positions)

    def load_codec(self, root: Path, codec: str | Path | None, device: str | torch.device) -> Any:
        """The codec bundled in the checkpoint; an explicit `codec` is a ConfigError (the talker was
        trained with the bundled one)."""
        if codec is not None:
            raise ConfigError(f"{root} is a v3 checkpoint with its codec bundled; do not pass a codec ({codec})")
        return load_codec_v3(root, device=device)

    def policy(self, cfg: TalkerV3Config, tokenizer: TokenizerLike) -> V3Policy:
        return V3Policy(cfg, tokenizer)

    def device_rules(self, cfg: TalkerV3Config) -> V3DeviceRules:
        return V3DeviceRules(cfg.num_codebooks)

    def make_checkpoint(self, out: str | Path, preset: str, layout: str, seed: int) -> Path:
        from higgs_stream.engine.models.higgs_v3.make_checkpoint import make_checkpoint_v3

        return make_checkpoint_v3(out, preset=preset, seed=seed)

    def random_talker(self, preset: str, device: str | torch.device, dtype: torch.dtype, max_positions: int,
                      seed: int) -> tuple[torch.nn.Module, TalkerV3Config, Any]:
        from higgs_stream.engine.models.higgs_v3.random_weights import random_talker

        return random_talker(preset, device, dtype, max_positions, seed)


FAMILY = HiggsV3()
