"""Random codec checkpoints in the real on-disk layouts (for tests and full-size performance runs).

The model is built through transformers' reference class `HiggsAudioV2TokenizerModel` (seeded), given
random weights that keep activations O(1) (its own init leaves the codebooks at zero), and then written:
- layout "hf": `save_pretrained` (config.json + model.safetensors), as the hub repo holds it now;
- layout "original": the same tensors under Boson's names (`original_names`), DAC convs weight-normed as
  `weight_g` (= ‖w‖ per dim-0 slice) / `weight_v` (= w), in `model.pth`, with the original config.json.
Random weights produce noise, never speech.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import torch
from higgs_stream.engine.codec.config import CodecConfig
from higgs_stream.engine.codec.layers import unfold_weight_norm
from higgs_stream.engine.codec.load import original_names
from higgs_stream.engine.errors import ConfigError
from torch import nn

Preset = Literal["tiny", "full"]


# Gain of the random decoder's last conv: random weights otherwise give a waveform ~35x full scale,
# clipped to a square wave at s16, where "within 1 LSB" comparisons and SNRs mean little.
OUTPUT_GAIN = 0.02


def preset_config(preset: Preset) -> CodecConfig:
    if preset == "tiny":
        return CodecConfig.tiny()
    if preset == "full":
        return CodecConfig.full()
    raise ConfigError(f"unknown codec preset {preset!r} (expected 'tiny' or 'full')")


@torch.no_grad()
def build_reference_model(cfg: CodecConfig, seed: int = 0) -> nn.Module:
    """A seeded random transformers `HiggsAudioV2TokenizerModel` for `cfg`, in eval mode."""
    from transformers import HiggsAudioV2TokenizerConfig, HiggsAudioV2TokenizerModel

    kwargs = cfg.to_hf_dict()
    kwargs.pop("model_type")
    torch.manual_seed(seed)
    model = HiggsAudioV2TokenizerModel(HiggsAudioV2TokenizerConfig(**kwargs)).eval()
    assert model.config.num_quantizers == cfg.num_quantizers, \
        f"reference has {model.config.num_quantizers} quantizers, config {cfg.num_quantizers}"
    assert model.config.hop_length == cfg.hop, f"reference hop {model.config.hop_length} != {cfg.hop}"

    gen = torch.Generator().manual_seed(seed)

    def normal_(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * std)

    for name, module in model.named_modules():
        if name.startswith("semantic_model"):
            continue  # HuBERT keeps its own (seeded) init
        if isinstance(module, nn.ConvTranspose1d):  # weight [in, out, k]; each output sees in*k/stride taps
            fan_in = module.in_channels * module.kernel_size[0] / module.stride[0]
            normal_(module.weight, 1 / math.sqrt(fan_in))
        elif isinstance(module, (nn.Conv1d, nn.Linear)):
            fan_in = module.weight[0].numel()
            # second conv of a residual unit is scaled down so 15 stacked residuals stay O(1)
            gain = 0.3 if name.endswith(("res_unit1.conv2", "res_unit2.conv2", "res_unit3.conv2")) else 1.0
            if name == "acoustic_decoder.conv2":  # the waveform: speech-like level (peak ~0.5, not ~35 and clipped)
                gain = OUTPUT_GAIN
            normal_(module.weight, gain / math.sqrt(fan_in))
            if module.bias is not None:
                normal_(module.bias, 0.1 * gain)
            continue
        else:
            if isinstance(getattr(module, "alpha", None), nn.Parameter):  # Snake1d (not ELU's float alpha)
                module.alpha.copy_(0.5 + torch.rand(module.alpha.shape, generator=gen))
            if hasattr(module, "embed_avg"):  # Euclidean codebook buffers
                normal_(module.embed, 1.0)
                module.embed_avg.copy_(module.embed)
                module.cluster_size.fill_(1.0)
            continue
        if module.bias is not None:
            normal_(module.bias, 0.1)
    return model


def original_state_dict(model: nn.Module, cfg: CodecConfig) -> dict[str, torch.Tensor]:
    """The reference model's tensors under Boson's original names, DAC convs weight-normed."""
    table = original_names(cfg)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        value = value.detach().clone()
        if key.startswith("semantic_model."):  # HuBERT names are shared; old-style weight-norm names
            key = key.replace(".parametrizations.weight.original0", ".weight_g")
            key = key.replace(".parametrizations.weight.original1", ".weight_v")
            out[key] = value
            continue
        module, _, param = key.rpartition(".")
        if module not in table:
            raise AssertionError(f"no original name for {key}")
        name = table[module]
        if param == "weight" and name.startswith(("encoder.", "decoder_2.")) and value.dim() == 3:
            out[f"{name}.weight_g"], out[f"{name}.weight_v"] = unfold_weight_norm(value)
        else:
            out[f"{name}.{param}"] = value
    # The real file also carries HuBERT's SpecAugment vector, which inference never uses.
    out["semantic_model.masked_spec_embed"] = torch.rand(cfg.semantic_dim)
    return out


def write_random_codec(out_dir: str | Path, preset: Preset = "tiny", layout: Literal["hf", "original"] = "hf",
                       seed: int = 0) -> Path:
    """Write a seeded random codec checkpoint; returns the directory."""
    cfg = preset_config(preset)
    if layout not in ("hf", "original"):
        raise ConfigError(f"unknown codec layout {layout!r} (expected 'hf' or 'original')")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_reference_model(cfg, seed)
    if layout == "hf":
        model.save_pretrained(out)
    else:
        torch.save(original_state_dict(model, cfg), out / "model.pth")
        (out / "config.json").write_text(json.dumps(cfg.to_original_dict(), indent=2) + "\n")
    return out
