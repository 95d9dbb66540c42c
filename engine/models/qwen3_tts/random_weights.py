"""Qwen3-TTS with seeded random weights, drawn in memory (benchmarks, GPU tests). Noise, never speech."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from higgs_stream.engine.checkpoint_files import parameters_on_meta
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.models.qwen3_tts.config import QwenTTSConfig, preset
from higgs_stream.engine.models.qwen3_tts.make_checkpoint import PRESET_NAMES, write_text_tokenizer
from higgs_stream.engine.models.qwen3_tts.talker import QwenTTSModel
from higgs_stream.engine.models.qwen3_tts.tokenizer import QwenTextTokenizer


@torch.no_grad()
def random_model(cfg: QwenTTSConfig, device: Any, dtype: torch.dtype, seed: int) -> QwenTTSModel:
    """The talker and code predictor drawn on the device at make_checkpoint.py's scales: matrices
    N(0, 1/fan_in), embeddings N(0, 1), norms 1, biases 0; every parameter in `dtype`."""
    with parameters_on_meta():
        model = QwenTTSModel(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, meta in sorted(model.named_parameters()):
        if meta.dim() == 1:
            value = torch.ones if "norm" in name and name.endswith("weight") else torch.zeros
            tensors[name] = value(meta.shape, device=device, dtype=dtype)
            continue
        noise = torch.randn(meta.shape, generator=gen, device=device, dtype=torch.float32)
        tensors[name] = (noise if "embedding" in name else noise / meta[0].numel() ** 0.5).to(dtype)
        del noise
    result = model.load_state_dict(tensors, strict=False, assign=True)
    assert not result.missing_keys and not result.unexpected_keys, f"QwenTTSModel keys: {result}"
    model.to(device)  # the RoPE buffers
    model.requires_grad_(False)
    return model.eval()


def text_tokenizer(cfg: QwenTTSConfig) -> QwenTextTokenizer:
    """make_checkpoint's stand-in text tokenizer for `cfg`, read back from a temporary directory."""
    tmp = Path(tempfile.mkdtemp(prefix="qwen3-tts-tokenizer-"))
    try:
        write_text_tokenizer(tmp, cfg)
        return QwenTextTokenizer.from_dir(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def random_talker(preset_name: str, device: Any, dtype: torch.dtype, max_positions: int,
                  seed: int) -> tuple[QwenTTSModel, QwenTTSConfig, QwenTextTokenizer]:
    """`tiny`, `full` (= `0.6b`) or `1.7b` (CustomVoice), drawn in memory (family.ModelFamily.random_talker)."""
    if preset_name not in PRESET_NAMES:
        raise ConfigError(f"unknown qwen3-tts preset {preset_name!r}; expected one of {PRESET_NAMES}")
    cfg = preset("0.6b" if preset_name == "full" else preset_name)
    return random_model(cfg, device, dtype, seed), cfg, text_tokenizer(cfg)
