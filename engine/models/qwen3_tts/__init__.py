"""Qwen3-TTS (`Qwen/Qwen3-TTS-12Hz-{0.6B,1.7B}-{Base,CustomVoice,VoiceDesign}`): a dual-track Qwen3
talker (one step per 80 ms frame emits code group 0), a code predictor that writes groups 1..15 of
that frame, and the causal 12 Hz tokenizer (16 x 2048 codes, 1920 samples per frame at 24 kHz).

    config.py           QwenTTSConfig (hub config.json + generation_config.json), presets 0.6b / 1.7b / tiny
    checkpoint.py       the hub on-disk layout, its loader and typed errors
    talker.py           the plain-torch talker and code predictor
    prompt.py           the three variants' prompt (CustomVoice, VoiceDesign, Base x-vector / ICL)
    policy.py           the engine's generation policy: request -> prompt, group-0 rules, frame writer
    tokenizer.py        the Qwen2 BPE text tokenizer from the hub files
    generate.py         one stream's reference loop (group-0 rules, code predictor, text track)
    speaker.py          the Base variant's speaker encoder (log-mel + ECAPA-TDNN x-vector), its loader
    codec/              the 12 Hz tokenizer: decoder, exact stateful streaming decoder, encoder, loader
    make_checkpoint.py  random-weight checkpoints in the hub layout (presets tiny / 0.6b / 1.7b, -base, -design)
    random_weights.py   random-weight models drawn in memory (benchmarks: `bench --arch qwen3-tts`)
    device_rules.py     the group-0 rules on the device (the fast path's; policy.py's host machines are the oracle)
    fast_predictor.py   the code predictor on the fast path's layer stack and kernels (inside the graphed step)

The engine serves it through the plain-torch RefRunner (every stream's talker step and its 15
code-predictor steps batched together) and through the fast path (ModelRunner: the talker on FastTalker's
kernels, the code predictor's 15 sub-steps and every group's sampling on the device, the whole
frame step one CUDA graph per batch bucket; prompts prefilled eagerly). The Base variant (in-context
cloning) takes reference audio: the codec that `load_codec` returns for a Base checkpoint encodes it
(the 12 Hz encoder: codes [16, T]) and embeds it (the checkpoint's speaker encoder: the x-vector), and
the server's encode thread builds the request's `Reference` from both; in Python a Base request may
also bring codes and an embedding itself. `--quantize` leaves the code predictor as loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from higgs_stream.engine.errors import CheckpointError
from higgs_stream.engine.family import TokenizerLike
from higgs_stream.engine.models.qwen3_tts.config import MODEL_TYPE, QwenTTSConfig

class Qwen3TTS:
    name = "qwen3_tts"
    arch = "qwen3-tts"
    summary = "Qwen3-TTS 12 Hz (talker + code predictor, causal 16x2048 codec)"
    model_types = (MODEL_TYPE,)
    config_type = QwenTTSConfig
    layouts = ("hf",)
    presets = ("tiny", "full", "0.6b", "1.7b", "tiny-base", "full-base", "0.6b-base", "1.7b-base", "tiny-design",
               "full-design", "0.6b-design", "1.7b-design")  # make_checkpoint.PRESETS
    # the frame step (talker, then 15 code-predictor sub-steps) gains nothing from programmatic dependent launch:
    # H200, 1.7B, replayed, two pairs in one call (session 23): 1 row 5.76 / 5.76 ms with it vs 5.76 / 5.76 without,
    # 4-32 rows 0.3-1.1 % slower (ModelRunnerConfig.pdl_max_rows: 0 unless given)
    decode_pdl = False

    def load(self, root: Path, device: str | torch.device, dtype: torch.dtype | None,
             max_positions: int) -> tuple[torch.nn.Module, QwenTTSConfig, Any]:
        from higgs_stream.engine.models.qwen3_tts.checkpoint import load_model

        from higgs_stream.engine.models.qwen3_tts.tokenizer import QwenTextTokenizer

        model = load_model(root, device=device, dtype=dtype)
        return model, model.cfg, QwenTextTokenizer.from_dir(root)

    def load_codec(self, root: Path, codec: str | Path | None, device: str | torch.device) -> Any:
        """The checkpoint's speech_tokenizer/ (or an explicit 12 Hz tokenizer folder); a Base checkpoint's
        codec also carries the checkpoint's speaker encoder (`speaker_embedding`)."""
        from higgs_stream.engine.checkpoint_files import read_config_json
        from higgs_stream.engine.models.qwen3_tts.codec.load import load_qwen_codec
        from higgs_stream.engine.models.qwen3_tts.speaker import load_speaker_encoder

        out = load_qwen_codec(codec if codec is not None else root, device=device)
        if read_config_json(root).get("tts_model_type") == "base":
            if not out.can_encode:
                raise CheckpointError(f"{root}: a Base checkpoint needs the 12 Hz tokenizer's encoder (encoder.* in "
                                      "speech_tokenizer/model.safetensors) to encode reference audio")
            out.speaker = load_speaker_encoder(root, device=device)
        return out

    def policy(self, cfg: QwenTTSConfig, tokenizer: TokenizerLike) -> Any:
        from higgs_stream.engine.models.qwen3_tts.policy import QwenPolicy

        return QwenPolicy(cfg, tokenizer)

    def device_rules(self, cfg: QwenTTSConfig) -> Any:
        from higgs_stream.engine.models.qwen3_tts.device_rules import QwenDeviceRules

        return QwenDeviceRules(cfg)

    def make_checkpoint(self, out: str | Path, preset: str, layout: str, seed: int) -> Path:
        from higgs_stream.engine.models.qwen3_tts.make_checkpoint import make_checkpoint_qwen

        return make_checkpoint_qwen(out, preset, seed)

    def random_talker(self, preset: str, device: str | torch.device, dtype: torch.dtype, max_positions: int,
                      seed: int) -> tuple[torch.nn.Module, QwenTTSConfig, Any]:
        from higgs_stream.engine.models.qwen3_tts.random_weights import random_talker

        return random_talker(preset, device, dtype, max_positions, seed)


FAMILY = Qwen3TTS()
