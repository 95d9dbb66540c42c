"""Which model family a checkpoint holds: the one registry, keyed by config.json `model_type`.

    config.json model_type               family (package)     --arch
    "higgs_audio_v2" (transformers)      higgs_v2             v2
    "higgs_audio" (Boson's original)     higgs_v2             v2
    "higgs_multimodal_qwen3"             higgs_v3             v3
    "qwen3_tts"                          qwen3_tts            qwen3-tts

Adding a family is adding its package under engine/models/ (its `FAMILY` implements
engine/family.py `ModelFamily`) and one line to `FAMILIES`. `Engine.from_pretrained`, the CLI, the
server and the random-weight builders resolve families here; nothing else names one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from higgs_stream.engine.batch import DEFAULT_MAX_POSITIONS
from higgs_stream.engine.checkpoint_files import CONFIG_FILE, read_config_json, resolve_model_dir
from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.family import ModelFamily
from higgs_stream.engine.models.higgs_v2 import FAMILY as HIGGS_V2
from higgs_stream.engine.models.higgs_v3 import FAMILY as HIGGS_V3
from higgs_stream.engine.models.qwen3_tts import FAMILY as QWEN3_TTS

FAMILIES: tuple[ModelFamily, ...] = (HIGGS_V2, HIGGS_V3, QWEN3_TTS)
DEFAULT_ARCH = FAMILIES[0].arch  # what `make-checkpoint` and `random:*` build without --arch
_BY_MODEL_TYPE: dict[str, ModelFamily] = {t: f for f in FAMILIES for t in f.model_types}
_BACKBONE_TYPES = ("llama", "qwen2", "qwen3")  # what the families' nested text configs declare


def family_named(arch: str) -> ModelFamily:
    """The family of a CLI `--arch` name; ConfigError for an unknown one."""
    for family in FAMILIES:
        if family.arch == arch:
            return family
    raise ConfigError(f"unknown arch {arch!r}; expected one of {tuple(f.arch for f in FAMILIES)}")


def family_of_dir(root: Path) -> ModelFamily:
    """The family of a checkpoint directory by its config.json model_type; CheckpointError otherwise."""
    model_type = read_config_json(root).get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        hint = ""
        if model_type in _BACKBONE_TYPES:  # a bare backbone config: the family's wrapper config is missing
            hint = (f" ({model_type!r} is a text backbone: a TTS checkpoint's config.json nests it under "
                    f"text_config / talker_config with the TTS model_type at the top)")
        raise CheckpointError(f"{root / CONFIG_FILE}: unknown model_type {model_type!r}; "
                              f"expected one of {sorted(_BY_MODEL_TYPE)}{hint}")
    return _BY_MODEL_TYPE[model_type]


def family_of_config(cfg: Any) -> ModelFamily:
    """The family whose talker config `cfg` is; ConfigError for anything else."""
    for family in FAMILIES:
        if isinstance(cfg, family.config_type):
            return family
    raise ConfigError(f"no model family for a {type(cfg).__name__}")


def model_arch(model: str | Path) -> str:
    """The `--arch` name of a checkpoint (local dir or hub id); CheckpointError for an unknown model_type."""
    return family_of_dir(resolve_model_dir(model)).arch


def load_model(
    model: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32,
    max_positions: int = DEFAULT_MAX_POSITIONS,
) -> tuple[torch.nn.Module, Any, Any]:
    """(talker, config with special ids, tokenizer) of any family; dtype None keeps the stored dtype."""
    root = resolve_model_dir(model)
    return family_of_dir(root).load(root, device, dtype, max_positions)


def load_codec_for(model: str | Path, codec: str | Path | None = None, device: str | torch.device = "cpu") -> Any:
    """The codec that decodes `model`'s codes (an engine.codec.Codec, fp32 on `device`): the family
    decides where it comes from (Higgs v2: `codec`, else MODEL/audio_tokenizer, else the hub codec;
    Higgs v3: the one bundled in the checkpoint, an explicit `codec` is a ConfigError)."""
    root = resolve_model_dir(model)
    return family_of_dir(root).load_codec(root, codec, device)
