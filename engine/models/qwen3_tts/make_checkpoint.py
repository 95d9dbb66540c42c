"""Random-weight Qwen3-TTS checkpoints in the hub layout (`make-checkpoint --arch qwen3-tts`):
config.json, generation_config.json, model.safetensors (talker.*, bf16), speech_tokenizer/
(config.json + decoder.* weights) and a text tokenizer (vocab.json, merges.txt,
tokenizer_config.json). Presets: `tiny` (the test shapes), `0.6b` / `full` and `1.7b` (the released
shapes: same bytes and FLOPs as the real models, noise not speech), each a CustomVoice checkpoint;
the suffix `-base` makes the Base variant (voice cloning) and `-design` VoiceDesign. A Base checkpoint
also holds the audio front end its requests need: config.json's speaker_encoder_config with
speaker_encoder.* in model.safetensors (bf16), and the 12 Hz encoder in speech_tokenizer/ (encoder_config,
encoder.* fp32). The other variants' speech_tokenizer/ holds the decoder only (decoding needs no
encoder; the released folders hold both).

The text tokenizer is a stand-in for Qwen's 151k-token BPE in the same files and format: byte-level
symbols (all 256 where the text vocabulary has room; the tiny preset's 150 regular ids hold printable
ASCII, newline and 43 more bytes), merges that make `assistant` and `user` one token each (as the chat
template needs), unreachable filler tokens up to the first special id, then the added tokens at
config.json's ids (<|im_start|>, <|im_end|>, the three TTS text tokens, <|endoftext|>; the TTS
tokens' names are ours, their ids are what the model reads).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.models.qwen3_tts.codec.codec import QwenCodec
from higgs_stream.engine.models.qwen3_tts.codec.config import FULL as FULL_CODEC
from higgs_stream.engine.models.qwen3_tts.codec.config import QwenCodecConfig
from higgs_stream.engine.models.qwen3_tts.codec.encoder import EncoderConfig, QwenEncoder
from higgs_stream.engine.models.qwen3_tts.codec.load import ENCODE_ONLY
from higgs_stream.engine.models.qwen3_tts.config import QwenTTSConfig, preset
from higgs_stream.engine.models.qwen3_tts.tokenizer import (
    CONFIG_FILE,
    IM_END,
    IM_START,
    MERGES_FILE,
    VOCAB_FILE,
    byte_symbols,
)
from higgs_stream.engine.models.qwen3_tts.speaker import SpeakerEncoder, SpeakerEncoderConfig
from higgs_stream.engine.models.qwen3_tts.talker import QwenTTSModel

PRESET_NAMES = ("tiny", "full", "0.6b", "1.7b")
VARIANT_SUFFIXES = {"": "custom_voice", "-base": "base", "-design": "voice_design"}
PRESETS = tuple(f"{p}{s}" for s in VARIANT_SUFFIXES for p in PRESET_NAMES)  # what make-checkpoint takes
TINY_ENCODER = EncoderConfig(hidden_size=12, num_filters=2, codebook_size=64, codebook_dim=8, num_quantizers=20,
                             vector_quantization_hidden_dimension=8, num_hidden_layers=1, intermediate_size=16,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=8)  # the fixture's shapes
FULL_ENCODER = EncoderConfig()  # transformers' MimiConfig defaults: the released encoder_config


def tiny_speaker(hidden: int) -> SpeakerEncoderConfig:
    return SpeakerEncoderConfig(enc_dim=hidden, enc_channels=(16, 16, 16, 32), enc_kernel_sizes=(5, 3, 3, 1),
                                enc_dilations=(1, 2, 3, 1), enc_attention_channels=8, enc_res2net_scale=4,
                                enc_se_channels=4)


def split_preset(name: str) -> tuple[str, str]:
    """`1.7b-base` -> ("1.7b", "base"); ConfigError for an unknown name."""
    for suffix, variant in sorted(VARIANT_SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        size = name[: len(name) - len(suffix)] if suffix else name
        if name.endswith(suffix) and size in PRESET_NAMES:
            return size, variant
    raise ConfigError(f"unknown qwen3-tts preset {name!r}; expected one of {PRESETS}")
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


RESIDUAL_GAIN = 0.3  # the decoder blocks' residual branches (their last 1x1 conv)
LAYER_SCALE = 0.01  # transformer layer scales and ConvNeXt gammas (the reference config's initial scale)
TARGET_RMS = 0.25  # pre-clamp output level on random codes


def _condition_decoder(codec: QwenCodec, seed: int) -> None:
    """Keep a random decoder's activations O(1), as scripts/qwen3_reference_fixtures.py does for its
    fixture: unit-gain residual branches and layer scales make the waveform grow block after block
    (and amplify fp32 rounding by orders of magnitude), and the output would sit in the final clamp.
    So: residual branches at RESIDUAL_GAIN, layer scales at LAYER_SCALE, and the last conv scaled for
    an output rms of TARGET_RMS on random codes."""
    dec = codec.decoder
    with torch.no_grad():
        for name, p in dec.named_parameters():
            if re.search(r"^decoder\.\d+\.block\.[234]\.conv2\.", name):
                p.mul_(RESIDUAL_GAIN)
            elif name.endswith((".gamma", "layer_scale.scale")):
                p.fill_(LAYER_SCALE)
        last = dec.decoder[-1].conv  # linear in its weight and bias: scaling both scales the output
        last.weight.mul_(1e-3)
        last.bias.mul_(1e-3)  # far inside the clamp now
        codes = torch.randint(0, codec.cfg.codebook_size, (1, codec.num_codebooks, 16),
                              generator=torch.Generator().manual_seed(seed))
        rms = float(codec.decode_codes(codes).pow(2).mean().sqrt())
        last.weight.mul_(TARGET_RMS / rms)
        last.bias.mul_(TARGET_RMS / rms)


def random_decoder(codec: QwenCodec, seed: int) -> QwenCodec:
    """The codec's decoder drawn at random (seed + 1) and conditioned (seed + 2: O(1) activations, output
    inside the clamp), in place, on its current device: what a written checkpoint holds; benchmarks and
    GPU tests draw the full-size one with it. Returns the codec."""
    _randomize(codec.decoder, seed + 1)
    _condition_decoder(codec, seed + 2)
    return codec


def _randomize_encoder(encoder: QwenEncoder, seed: int) -> None:
    """_randomize, then the codebook buffers (centroids N(0, 1), usage 1) and small layer scales."""
    _randomize(encoder, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in encoder.named_buffers():
            if name.endswith("embed_sum"):
                b.copy_(torch.randn(b.shape, generator=g))
        for name, p in encoder.named_parameters():
            if name.endswith("layer_scale.scale"):
                p.fill_(LAYER_SCALE)


def make_checkpoint_qwen(out: str | Path, preset_name: str = "tiny", seed: int = 0,
                         variant: str | None = None) -> Path:
    """`preset_name`: a size with an optional variant suffix (PRESETS); `variant` overrides the suffix's."""
    preset_name, named = split_preset(preset_name)
    variant = variant or named
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {out} exists and is not an empty directory")
    cfg = preset("0.6b" if preset_name == "full" else preset_name, variant)
    codec_cfg = TINY_CODEC if preset_name == "tiny" else FULL_CODEC
    out.mkdir(parents=True, exist_ok=True)
    base = variant == "base"
    config, generation = cfg.to_json()
    speaker_cfg = (tiny_speaker(cfg.hidden_size) if preset_name == "tiny"
                   else SpeakerEncoderConfig(enc_dim=cfg.hidden_size)) if base else None
    if speaker_cfg is not None:
        config["speaker_encoder_config"] = speaker_cfg.to_json()
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    model = QwenTTSModel(cfg)
    _randomize(model, seed)
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "inv_freq"
               and not k.endswith(".inv_freq")}
    del model
    if speaker_cfg is not None:
        speaker = SpeakerEncoder(speaker_cfg)
        _randomize(speaker, seed + 3)
        weights.update({f"speaker_encoder.{k}": v.to(torch.bfloat16).contiguous()
                        for k, v in speaker.state_dict().items()})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    del weights
    if base:
        enc_cfg = TINY_ENCODER if preset_name == "tiny" else FULL_ENCODER
        codec_cfg = replace(codec_cfg, encoder=enc_cfg.to_json())
    codec_dir = out / "speech_tokenizer"
    codec_dir.mkdir()
    (codec_dir / "config.json").write_text(json.dumps(codec_cfg.to_json(), indent=2) + "\n")
    codec = QwenCodec(codec_cfg, with_encoder=base)
    random_decoder(codec, seed)
    tensors = {f"decoder.{k}": v.contiguous() for k, v in codec.decoder.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 5)
    for key in ENCODE_ONLY:  # the decoder quantizer's encode-side projections: stored by the hub layout, never run
        dim = codec_cfg.codebook_dim
        tensors[key] = torch.randn((dim // 2, dim, 1), generator=g) / dim ** 0.5
    if codec.encoder is not None:
        _randomize_encoder(codec.encoder, seed + 4)
        tensors.update({f"encoder.{k}": v.contiguous() for k, v in codec.encoder.state_dict().items()})
    save_file(tensors, codec_dir / "model.safetensors", metadata={"format": "pt"})
    write_text_tokenizer(out, cfg)
    return out


WORDS = ("assistant", "user")  # the chat template's role names: one token each


def write_text_tokenizer(out: Path, cfg: QwenTTSConfig) -> None:
    """The stand-in text tokenizer (module docstring) in the hub's three files."""
    named = {cfg.im_start_id: IM_START, cfg.im_end_id: IM_END, cfg.tts_pad_id: "<tts_pad>",
             cfg.tts_bos_id: "<tts_text_bos>", cfg.tts_eos_id: "<tts_text_eod>"}
    first, last = min(named), max(named)
    gaps = [i for i in range(first, last) if i not in named]
    named[gaps[0] if gaps else last + 1] = "<|endoftext|>"
    if max(named) >= cfg.text_vocab_size:
        raise ConfigError(f"the text tokenizer's ids reach {max(named)}, past text_vocab_size {cfg.text_vocab_size}")
    merges = [(w[:i], w[i]) for w in WORDS for i in range(1, len(w))]
    symbols = byte_symbols()
    order = [*range(0x20, 0x7F), 0x0A, *(b for b in range(256) if not (0x20 <= b < 0x7F or b == 0x0A))]
    room = first - len(merges)
    if room < 96:
        raise ConfigError(f"a text tokenizer needs 96 byte symbols and {len(merges)} merges below id {first}")
    vocab = {symbols[b]: i for i, b in enumerate(order[:room])}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    while len(vocab) < first:  # ids below the specials that no text reaches
        vocab[f"<|filler_{len(vocab)}|>"] = len(vocab)
    added = {str(i): dict(content=named.get(i, f"<|reserved_{i}|>"), lstrip=False, normalized=False, rstrip=False,
                          single_word=False, special=True) for i in range(first, max(named) + 1)}
    (out / VOCAB_FILE).write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / MERGES_FILE).write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    config = dict(tokenizer_class="Qwen2Tokenizer", add_prefix_space=False, added_tokens_decoder=added,
                  bos_token=None, eos_token=IM_END, pad_token="<|endoftext|>", unk_token=None, errors="replace",
                  model_max_length=cfg.max_position_embeddings, clean_up_tokenization_spaces=False,
                  split_special_tokens=False)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
