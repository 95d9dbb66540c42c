"""Loading the 12 Hz tokenizer from its on-disk layout (the hub repos' `speech_tokenizer/` folder:
config.json with model_type qwen3_tts_tokenizer_12hz + model.safetensors, keys `encoder.*` (Mimi)
and `decoder.*`). Our decoder's and encoder's names are the checkpoint's under `decoder.` and
`encoder.`; the decoder quantizer's `input_proj` (an encode-side projection of the original training
code) is stored and never run. A folder without `encoder.*` tensors loads as a decode-only codec
(`can_encode` False); with them, every encoder tensor must be there. Every missing, unexpected or
mis-shaped tensor is a CheckpointError naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from higgs_stream.engine.checkpoint_files import check_keys, check_layer_count, os_error_message, read_config_json, weight_files
from higgs_stream.engine.errors import CheckpointError
from higgs_stream.engine.models.qwen3_tts.codec.codec import QwenCodec
from higgs_stream.engine.models.qwen3_tts.codec.config import QwenCodecConfig
from higgs_stream.engine.models.qwen3_tts.config import MODEL_TYPE as TALKER_MODEL_TYPE

SUBFOLDER = "speech_tokenizer"  # where a talker checkpoint keeps its codec
DECODER_PREFIX = "decoder."
ENCODER_PREFIX = "encoder."
ENCODE_ONLY = ("decoder.quantizer.rvq_first.input_proj.weight", "decoder.quantizer.rvq_rest.input_proj.weight")


def is_talker_checkpoint(root: Path) -> bool:
    """A Qwen3-TTS talker checkpoint's folder (its config.json names the talker's model_type), not a codec's."""
    try:
        return read_config_json(root).get("model_type") == TALKER_MODEL_TYPE
    except CheckpointError:  # no config.json or not JSON: the codec's own reader says so
        return False


def load_qwen_codec(root: str | Path, device: str | torch.device = "cpu") -> QwenCodec:
    """The codec in `root` (a speech_tokenizer folder, or a talker checkpoint holding one), fp32 on `device`."""
    root = Path(root)
    if (root / SUBFOLDER).is_dir():
        root = root / SUBFOLDER
    elif is_talker_checkpoint(root):  # its config.json is the talker's: "expected qwen3_tts_tokenizer_12hz" misled
        raise CheckpointError(f"{root}: no {SUBFOLDER}/ folder (the 12 Hz codec the checkpoint needs): restore it, or "
                              "name the tokenizer folder with --codec")
    cfg = QwenCodecConfig.from_json(read_config_json(root), source=str(root / "config.json"))
    files, _ = weight_files(root)
    stored: dict[str, torch.Tensor] = {}
    encoder: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.startswith(DECODER_PREFIX) and key not in ENCODE_ONLY:
                        stored[key[len(DECODER_PREFIX):]] = f.get_tensor(key)
                    elif key.startswith(ENCODER_PREFIX):
                        encoder[key[len(ENCODER_PREFIX):]] = f.get_tensor(key)
                    elif key not in ENCODE_ONLY:
                        raise CheckpointError(f"{file}: unexpected tensor {key} (neither encoder.* nor decoder.*)")
        except CheckpointError:
            raise
        except OSError as e:
            raise CheckpointError(f"cannot read {file}: {os_error_message(e)}") from e
        except Exception as e:  # a corrupt file
            raise CheckpointError(f"cannot read {file}: {e}") from e
    # before the codec is built (for real, per layer): an absurd count must not hang
    check_layer_count(cfg.num_hidden_layers, stored, "pre_transformer.layers.", "decoder_config.num_hidden_layers",
                      root / "config.json")
    codec = QwenCodec(cfg, with_encoder=bool(encoder))
    load_decoder_state(codec, stored, str(root))
    if encoder:
        load_state(codec.encoder, encoder, ENCODER_PREFIX, str(root))
    return codec.to(device)


def load_state(module: torch.nn.Module, stored: dict[str, torch.Tensor], prefix: str, source: str) -> None:
    """Copy `stored` (names under `prefix`) into every parameter and persistent buffer of `module`, as fp32."""
    want = module.state_dict()
    check_keys(want, stored, prefix, source)
    with torch.no_grad():
        for name, t in want.items():
            t.copy_(stored[name].to(torch.float32))


def load_decoder_state(codec: QwenCodec, stored: dict[str, torch.Tensor], source: str) -> None:
    """Copy `stored` (names relative to `decoder.`) into the codec's decoder, checking every key and shape."""
    params = dict(codec.decoder.named_parameters())
    check_keys(params, stored, DECODER_PREFIX, source)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(stored[name].to(torch.float32))
