"""Which model family a checkpoint holds, and the one place that loads each family's parts.

    config.json model_type               family   talker + tokenizer             codec (load_codec_for)
    "higgs_audio_v2" (transformers)      v2       checkpoint.load_talker         --codec, else MODEL/audio_tokenizer,
    "higgs_audio" (Boson's original)     v2       checkpoint.load_talker         else the hub v2 codec
    "higgs_multimodal_qwen3"             v3       checkpoint_v3.load_talker_v3   bundled in the weights

`Engine.from_pretrained` and the CLI dispatch through here; the engine itself only sees the
family's `GenerationPolicy` (`policy_for`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from higgs_stream.engine.checkpoint import (
    CONFIG_FILE,
    MODEL_TYPES,
    find_codec_dir,
    load_talker,
    read_config_json,
    resolve_model_dir,
)
from higgs_stream.engine.config import TalkerConfig
from higgs_stream.engine.config_v3 import MODEL_TYPE_V3, TalkerV3Config
from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.generation import GenerationPolicy, V2Policy
from higgs_stream.engine.generation_v3 import V3Policy
from higgs_stream.engine.talker import DEFAULT_MAX_POSITIONS
from higgs_stream.engine.tokenizer import TextTokenizer

ARCHS: dict[str, str] = {**{t: "v2" for t in MODEL_TYPES}, MODEL_TYPE_V3: "v3"}  # model_type -> family


def model_arch(model: str | Path) -> str:
    """"v2" or "v3" from the checkpoint's config.json model_type; CheckpointError otherwise."""
    return _arch_of(resolve_model_dir(model))


def _arch_of(root: Path) -> str:
    model_type = read_config_json(root).get("model_type")
    if model_type not in ARCHS:
        raise CheckpointError(f"{root / CONFIG_FILE}: unknown model_type {model_type!r}; expected one of {sorted(ARCHS)}")
    return ARCHS[model_type]


def load_model(
    model: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32,
    max_positions: int = DEFAULT_MAX_POSITIONS,
) -> tuple[torch.nn.Module, TalkerConfig | TalkerV3Config, TextTokenizer]:
    """(talker, config with special ids, tokenizer) of either family; dtype None keeps the stored dtype."""
    root = resolve_model_dir(model)
    if _arch_of(root) == "v3":
        from higgs_stream.engine.checkpoint_v3 import load_talker_v3

        return load_talker_v3(root, device=device, dtype=dtype, max_positions=max_positions)
    return load_talker(root, device=device, dtype=dtype, max_positions=max_positions)


def load_codec_for(model: str | Path, codec: str | Path | None = None, device: str | torch.device = "cpu"):
    """The codec that decodes `model`'s codes (an engine.codec.Codec, fp32 on `device`).

    v3: the codec bundled in the checkpoint (an explicit `codec` is a ConfigError: the talker was
    trained with that one). v2: `codec` when given, else MODEL/audio_tokenizer, else the hub codec.
    """
    from higgs_stream.engine.codec import load_codec

    root = resolve_model_dir(model)
    if _arch_of(root) == "v3":
        from higgs_stream.engine.checkpoint_v3 import load_codec_v3

        if codec is not None:
            raise ConfigError(f"{model} is a v3 checkpoint with its codec bundled; do not pass a codec ({codec})")
        return load_codec_v3(root, device=device)
    return load_codec(codec if codec is not None else find_codec_dir(root), device=device)


def family_of(cfg: TalkerConfig | TalkerV3Config) -> str:
    """"v2" or "v3" for a talker config; ConfigError for anything else."""
    if isinstance(cfg, TalkerV3Config):
        return "v3"
    if isinstance(cfg, TalkerConfig):
        return "v2"
    raise ConfigError(f"no model family for a {type(cfg).__name__}")


def policy_for(cfg: TalkerConfig | TalkerV3Config, tokenizer: TextTokenizer) -> GenerationPolicy:
    """The engine's generation policy for a talker config of either family."""
    return V3Policy(cfg, tokenizer) if family_of(cfg) == "v3" else V2Policy(cfg, tokenizer)
