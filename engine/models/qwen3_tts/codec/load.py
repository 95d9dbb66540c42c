"""Loading the 12 Hz tokenizer from its on-disk layout (the hub repos' `speech_tokenizer/` folder:
config.json with model_type qwen3_tts_tokenizer_12hz + model.safetensors, keys `encoder.*` (Mimi)
and `decoder.*`). Our decoder's parameter names are the checkpoint's under `decoder.`; the
quantizer's `input_proj` (an encode-side projection) and the `encoder.*` tensors are read by the
encoder only. Every missing, unexpected or mis-shaped decoder tensor is a CheckpointError naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from higgs_stream.engine.checkpoint_files import read_config_json, weight_files
from higgs_stream.engine.errors import CheckpointError
from higgs_stream.engine.models.qwen3_tts.codec.codec import QwenCodec
from higgs_stream.engine.models.qwen3_tts.codec.config import QwenCodecConfig

SUBFOLDER = "speech_tokenizer"  # where a talker checkpoint keeps its codec
DECODER_PREFIX = "decoder."
ENCODE_ONLY = ("decoder.quantizer.rvq_first.input_proj.weight", "decoder.quantizer.rvq_rest.input_proj.weight")


def load_qwen_codec(root: str | Path, device: str | torch.device = "cpu") -> QwenCodec:
    """The codec in `root` (a speech_tokenizer folder, or a talker checkpoint holding one), fp32 on `device`."""
    root = Path(root)
    if (root / SUBFOLDER).is_dir():
        root = root / SUBFOLDER
    cfg = QwenCodecConfig.from_json(read_config_json(root), source=str(root / "config.json"))
    codec = QwenCodec(cfg)
    files, _ = weight_files(root)
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.startswith(DECODER_PREFIX) and key not in ENCODE_ONLY:
                        stored[key[len(DECODER_PREFIX):]] = f.get_tensor(key)
                    elif not key.startswith("encoder.") and key not in ENCODE_ONLY:
                        raise CheckpointError(f"{file}: unexpected tensor {key} (neither encoder.* nor decoder.*)")
        except CheckpointError:
            raise
        except Exception as e:  # a corrupt file
            raise CheckpointError(f"cannot read {file}: {e}") from e
    load_decoder_state(codec, stored, str(root))
    return codec.to(device)


def load_decoder_state(codec: QwenCodec, stored: dict[str, torch.Tensor], source: str) -> None:
    """Copy `stored` (names relative to `decoder.`) into the codec's decoder, checking every key and shape."""
    params = dict(codec.decoder.named_parameters())
    missing = sorted(set(params) - set(stored))
    if missing:
        raise CheckpointError(f"{source}: missing tensor {DECODER_PREFIX}{missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    unexpected = sorted(set(stored) - set(params))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {DECODER_PREFIX}{unexpected[0]}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    with torch.no_grad():
        for name, p in params.items():
            t = stored[name]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{source}: tensor {DECODER_PREFIX}{name} has shape {tuple(t.shape)}, "
                                      f"the config gives {tuple(p.shape)}")
            p.copy_(t.to(torch.float32))
