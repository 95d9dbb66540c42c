"""Random-weight Qwen3-TTS checkpoints in the hub layout (`make-checkpoint --arch qwen3-tts`):
config.json, generation_config.json, model.safetensors (talker.*, bf16) and speech_tokenizer/
(config.json + decoder.* weights). Presets: `tiny` (the test shapes), `0.6b` / `full` and `1.7b`
(the released shapes: same bytes and FLOPs as the real models, noise not speech). No text tokenizer
files are written (the Qwen2 BPE files are the real checkpoint's). The codec's Mimi encoder is not
written either: decoding needs none of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.models.qwen3_tts.codec.codec import QwenCodec
from higgs_stream.engine.models.qwen3_tts.codec.config import FULL as FULL_CODEC
from higgs_stream.engine.models.qwen3_tts.codec.config import QwenCodecConfig
from higgs_stream.engine.models.qwen3_tts.config import preset
from higgs_stream.engine.models.qwen3_tts.talker import QwenTTSModel

PRESET_NAMES = ("tiny", "full", "0.6b", "1.7b")
TINY_CODEC = QwenCodecConfig(codebook_size=64, codebook_dim=8, latent_dim=12, hidden_size=16, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=8, intermediate_size=24,
                             sliding_window=4, decoder_dim=32)


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Seeded weights at scales that keep activations O(1): matrices N(0, 1/fan_in), embeddings N(0, 1),
    norms 1, biases 0, codebook usage 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("cluster_usage", "scale", "gamma") or (p.dim() == 1 and "norm" in name and leaf == "weight"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            elif "embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)


def make_checkpoint_qwen(out: str | Path, preset_name: str = "tiny", seed: int = 0,
                         variant: str = "custom_voice") -> Path:
    if preset_name not in PRESET_NAMES:
        raise ConfigError(f"unknown qwen3-tts preset {preset_name!r}; expected one of {PRESET_NAMES}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {out} exists and is not an empty directory")
    cfg = preset("0.6b" if preset_name == "full" else preset_name, variant)
    codec_cfg = TINY_CODEC if preset_name == "tiny" else FULL_CODEC
    out.mkdir(parents=True, exist_ok=True)
    config, generation = cfg.to_json()
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    model = QwenTTSModel(cfg)
    _randomize(model, seed)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "inv_freq"
               and not k.endswith(".inv_freq")}, out / "model.safetensors", metadata={"format": "pt"})
    del model
    codec_dir = out / "speech_tokenizer"
    codec_dir.mkdir()
    (codec_dir / "config.json").write_text(json.dumps(codec_cfg.to_json(), indent=2) + "\n")
    codec = QwenCodec(codec_cfg)
    _randomize(codec.decoder, seed + 1)
    with torch.no_grad():
        codec.decoder.decoder[-1].conv.weight.mul_(0.1)
    save_file({f"decoder.{k}": v.contiguous() for k, v in codec.decoder.state_dict().items()},
              codec_dir / "model.safetensors", metadata={"format": "pt"})
    return out
