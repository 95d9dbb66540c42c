"""The Qwen3-TTS checkpoint in the hub repos' on-disk layout (what qwen-tts 0.1.1's
`Qwen3TTSForConditionalGeneration.from_pretrained` reads):

    config.json               model_type qwen3_tts, talker_config (+ code_predictor_config), text ids
    generation_config.json    sampling defaults (talker and "subtalker")
    model.safetensors         talker.* (+ speaker_encoder.* in the Base variant), often bf16;
                              or model.safetensors.index.json + shards
    speech_tokenizer/         the 12 Hz codec (codec/load.py)
    vocab.json, merges.txt, tokenizer_config.json   the Qwen2 text tokenizer (or tokenizer.json; tokenizer.py)

Our module names are the checkpoint's (`talker.*`). `speaker_encoder.*` (the Base variant's x-vector
encoder) is not the talker's: speaker.py loads it, fp32, beside the codec (the family's `load_codec`).
Every missing, unexpected or mis-shaped talker tensor is a CheckpointError naming the key.
"""

from __future__ import annotations

from pathlib import Path

import torch

from higgs_stream.engine.checkpoint_files import (
    GENERATION_FILE,
    check_keys,
    check_layer_count,
    read_config_json,
    read_generation_config,
    read_headers,
    weight_files,
)
from higgs_stream.engine.models.qwen3_tts.config import QwenTTSConfig
from higgs_stream.engine.models.qwen3_tts.talker import QwenTTSModel
from safetensors import safe_open

from higgs_stream.kernels.rope import llama3_inv_freq

UNUSED_PREFIXES = ("speaker_encoder.",)  # read by speaker.py, not by the talker (see the module docstring)


def load_config(root: Path) -> QwenTTSConfig:
    """config.json and (when present) generation_config.json; CheckpointError naming the file and the field."""
    return QwenTTSConfig.from_json(read_config_json(root), read_generation_config(root),
                                   source=str(root / "config.json"), generation_source=str(root / GENERATION_FILE))


def load_model(root: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = torch.float32) -> QwenTTSModel:
    """The talker and code predictor of `root` on `device` (dtype None: as stored)."""
    root = Path(root)
    cfg = load_config(root)
    files, weight_map = weight_files(root)
    entries = read_headers(files, weight_map)
    # the layer counts before a module is built per layer (an absurd count must not hang)
    source = root / "config.json"
    check_layer_count(cfg.num_layers, entries, "talker.model.layers.", "talker_config.num_hidden_layers", source)
    check_layer_count(cfg.code_predictor.num_layers, entries, "talker.code_predictor.model.layers.",
                      "talker_config.code_predictor_config.num_hidden_layers", source)
    with torch.device("meta"):
        model = QwenTTSModel(cfg)
    params = dict(model.named_parameters())
    stored = {k: e for k, e in entries.items() if not k.startswith(UNUSED_PREFIXES)}
    check_keys(params, stored, "", str(root))
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())  # the real tensors now
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in params:
                        t = f.get_tensor(key)
                        params[key].copy_(t.to(dtype if dtype is not None else t.dtype))
        # derived buffers (RoPE frequencies) were built on meta: compute them for real
        model.inv_freq = llama3_inv_freq(cfg.head_dim, cfg.rope_theta, None).to(device)
        cp = cfg.code_predictor
        model.talker.code_predictor.inv_freq = llama3_inv_freq(cp.head_dim, cp.rope_theta, None).to(device)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval().requires_grad_(False)
