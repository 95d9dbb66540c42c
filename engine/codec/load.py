"""Codec checkpoint loading for both on-disk layouts, plus a state-dict entry point for bundled codecs.

Layouts (research/higgs_v2_reference.md §2.4, higgs_v3_peers.md §2):
- "hf": transformers-native `config.json` (model_type higgs_audio_v2_tokenizer) + `model.safetensors`.
  Our module names are these names. A talker checkpoint may bundle the same layout under a prefix
  (Higgs v3: `models/higgs_v3/checkpoint.CODEC_PREFIX`; pass it as `prefix`).
- "original": Boson's `config.json` (n_q, ratios, D, ...) + `model.pth`, weight-normed DAC convs as
  `weight_g`/`weight_v`. Names differ by module path only; `ORIGINAL_NAMES` below is the table.

Weight norm in any of its stored forms (`weight_g`/`weight_v`, `parametrizations.weight.original0/1`)
is folded into a plain `weight` before names are matched. Every missing, unexpected or mis-shaped
tensor is a CheckpointError naming the checkpoint key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from higgs_stream.engine.checkpoint_files import (
    check_layer_count,
    os_error_message,
    read_json_file,
    read_weight_map,
    shard_path,
)
from higgs_stream.engine.codec.codec import Codec
from higgs_stream.engine.codec.config import CodecConfig
from higgs_stream.engine.codec.layers import fold_weight_norm
from higgs_stream.engine.errors import CheckpointError, ConfigError

Layout = Literal["hf", "original"]
DEFAULT_HUB_ID = "bosonai/higgs-audio-v2-tokenizer"

_RU = ("snake1", "conv1", "snake2", "conv2")  # residual unit children, in original Sequential order


def original_names(cfg: CodecConfig) -> dict[str, str]:
    """Module-path table: our (= transformers-native) module -> Boson's original module."""
    t: dict[str, str] = {}
    n = len(cfg.encoder_ratios)
    t["acoustic_encoder.conv1"] = "encoder.block.0"
    for i in range(n):
        o = f"encoder.block.{i + 1}.block"
        for j in range(3):
            for c, child in enumerate(_RU):
                t[f"acoustic_encoder.block.{i}.res_unit{j + 1}.{child}"] = f"{o}.{j}.block.{c}"
        t[f"acoustic_encoder.block.{i}.snake1"] = f"{o}.3"
        t[f"acoustic_encoder.block.{i}.conv1"] = f"{o}.4"
    t["acoustic_encoder.snake1"] = f"encoder.block.{n + 1}"
    t["acoustic_encoder.conv2"] = f"encoder.block.{n + 2}"

    n = len(cfg.decoder_ratios)
    t["acoustic_decoder.conv1"] = "decoder_2.model.0"
    for i in range(n):
        o = f"decoder_2.model.{i + 1}.block"
        t[f"acoustic_decoder.block.{i}.snake1"] = f"{o}.0"
        t[f"acoustic_decoder.block.{i}.conv_t1"] = f"{o}.1"
        for j in range(3):
            for c, child in enumerate(_RU):
                t[f"acoustic_decoder.block.{i}.res_unit{j + 1}.{child}"] = f"{o}.{j + 2}.block.{c}"
    t["acoustic_decoder.snake1"] = f"decoder_2.model.{n + 1}"
    t["acoustic_decoder.conv2"] = f"decoder_2.model.{n + 2}"

    for k in range(cfg.num_quantizers):
        for child in ("project_in", "project_out"):
            t[f"quantizer.quantizers.{k}.{child}"] = f"quantizer.vq.layers.{k}.{child}"
        t[f"quantizer.quantizers.{k}.codebook"] = f"quantizer.vq.layers.{k}._codebook"
    t["fc"], t["fc1"], t["fc2"] = "fc_prior", "fc_post1", "fc_post2"

    # xcodec semantic modules wrap most convs in a module holding `.conv` (1x1 convs are bare).
    nb, nu = len(cfg.semantic_strides), len(cfg.semantic_block_dilations)
    t["encoder_semantic.conv"] = "encoder_semantic.conv.conv"
    t["decoder_semantic.conv1"] = "decoder_semantic.conv1.conv"
    t["decoder_semantic.conv2"] = "decoder_semantic.conv2.conv"
    for side in ("encoder_semantic", "decoder_semantic"):
        for b in range(nb):
            t[f"{side}.conv_blocks.{b}.conv"] = f"{side}.conv_blocks.{b}.conv.conv"
            for u in range(nu):
                t[f"{side}.conv_blocks.{b}.res_units.{u}.conv1"] = f"{side}.conv_blocks.{b}.res_units.{u}.conv1.conv"
                t[f"{side}.conv_blocks.{b}.res_units.{u}.conv2"] = f"{side}.conv_blocks.{b}.res_units.{u}.conv2"
    return t


# Stored but never used at inference (research §2.3): skipped on load in either layout (our names).
_IGNORED = re.compile(r"^(decoder_semantic\.|fc1\.|semantic_model\.masked_spec_embed$|"
                      r"quantizer\.quantizers\.\d+\.codebook\.(embed_avg|cluster_size|inited)$)")
_ENCODER_ONLY = re.compile(r"^(acoustic_encoder\.|encoder_semantic\.|semantic_model\.|fc\.|"
                           r"quantizer\.quantizers\.\d+\.project_in\.)")


def is_encoder_key(key: str) -> bool:
    """True for tensors only the reference-audio encoder needs (our names)."""
    return bool(_ENCODER_ONLY.match(key))


def fold_all_weight_norm(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Replace every (g, v) weight-norm pair by its folded `weight`; an unpaired half is an error."""
    pairs = ((".weight_g", ".weight_v"), (".parametrizations.weight.original0", ".parametrizations.weight.original1"))
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        pair = next((p for p in pairs if key.endswith(p)), None)
        if pair is None:
            out[key] = value
            continue
        base = key[: -len(next(s for s in pair if key.endswith(s)))]
        g_key, v_key = base + pair[0], base + pair[1]
        for need in (g_key, v_key):
            if need not in state:
                raise CheckpointError(f"codec checkpoint: {prefix + need} is missing (its weight-norm partner is present)")
        if base + ".weight" in state:
            raise CheckpointError(f"codec checkpoint: {prefix + base}.weight is stored both plain and weight-normed")
        if key == g_key:
            try:
                out[base + ".weight"] = fold_weight_norm(state[g_key], state[v_key])
            except AssertionError as e:
                raise CheckpointError(f"codec checkpoint: bad weight norm at {prefix + base}: {e}") from e
    return out


def codec_from_state_dict(state: Mapping[str, torch.Tensor], cfg: CodecConfig, *, layout: Layout = "hf",
                          prefix: str = "", device: str | torch.device = "cpu",
                          with_encoder: bool | None = None) -> Codec:
    """Build a Codec from a state dict in either layout; only keys under `prefix` are considered.

    with_encoder: True requires the encode weights, False skips them, None loads them iff present.
    Decode weights are always required. The codec is fp32.
    """
    if layout not in ("hf", "original"):
        raise CheckpointError(f"unknown codec layout {layout!r}")
    src = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not src:
        raise CheckpointError(f"codec checkpoint: no tensors under prefix {prefix!r}")
    src = fold_all_weight_norm(src, prefix)
    # Counts before anything is built per quantizer / HuBERT layer, so an absurd config cannot hang;
    # fewer than the files hold is left to the key check below (it names the unexpected key).
    q_prefix = "quantizer.vq.layers." if layout == "original" else "quantizer.quantizers."
    check_layer_count(cfg.num_quantizers, src, q_prefix, "the config's quantizer count", "codec checkpoint",
                      "quantizers", exact=False)
    hubert = "semantic_model.encoder.layers."
    if any(k.startswith(hubert) for k in src):
        check_layer_count(cfg.semantic_model["num_hidden_layers"], src, hubert,
                          "semantic_model_config.num_hidden_layers", "codec checkpoint", exact=False)

    to_ckpt = original_names(cfg) if layout == "original" else {}
    from_ckpt = {v: k for k, v in to_ckpt.items()}

    def ours(ckpt_key: str) -> str | None:
        module, _, param = ckpt_key.rpartition(".")
        if layout == "original":
            if ckpt_key.startswith("semantic_model."):
                return ckpt_key
            return f"{from_ckpt[module]}.{param}" if module in from_ckpt else None
        if module.endswith(".codebook") and param == "weight":  # OmniVoice / v3 spelling of the codebook
            return f"{module}.embed"
        return ckpt_key

    def theirs(our_key: str) -> str:
        module, _, param = our_key.rpartition(".")
        return prefix + (f"{to_ckpt[module]}.{param}" if module in to_ckpt else our_key)

    tensors: dict[str, torch.Tensor] = {}
    for ckpt_key, value in src.items():
        key = ours(ckpt_key)
        if key is None:
            raise CheckpointError(f"codec checkpoint: unexpected key {prefix + ckpt_key}")
        if _IGNORED.match(key):
            continue
        if key in tensors:
            raise CheckpointError(f"codec checkpoint: {prefix + ckpt_key} duplicates another name for {key}")
        tensors[key] = value

    has_encoder = any(is_encoder_key(k) for k in tensors)
    if with_encoder is None:
        with_encoder = has_encoder
    if not with_encoder:
        tensors = {k: v for k, v in tensors.items() if not is_encoder_key(k)}

    with torch.device("meta"):
        codec = Codec(cfg, with_encoder=with_encoder)
    expected = codec.state_dict()
    for key, ref in expected.items():
        if key not in tensors:
            hint = " (the encoder part is incomplete)" if is_encoder_key(key) and has_encoder else ""
            raise CheckpointError(f"codec checkpoint: missing key {theirs(key)}{hint}")
        if tuple(tensors[key].shape) != tuple(ref.shape):
            raise CheckpointError(f"codec checkpoint: {theirs(key)} has shape {tuple(tensors[key].shape)}, "
                                  f"expected {tuple(ref.shape)} for this config")
    for key in tensors:
        if key not in expected:
            raise CheckpointError(f"codec checkpoint: unexpected key {theirs(key)}")
    codec.load_state_dict({k: v.detach().to(torch.float32) for k, v in tensors.items()}, strict=True, assign=True)
    return codec.requires_grad_(False).to(device).eval()


# ---------------------------------------------------------------- files on disk


def resolve_codec_dir(path_or_hub: str | Path) -> Path:
    """An existing local directory, else a hub repo id fetched with huggingface_hub.snapshot_download."""
    p = Path(path_or_hub).expanduser()
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"codec path {p} is not a directory")
        return p
    name = str(path_or_hub)
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise CheckpointError(f"codec {name!r}: no such directory, and not a hub repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=["config.json", "*.safetensors",
                                                                    "*.safetensors.index.json", "model.pth"]))
    except Exception as e:  # any hub/network failure becomes a typed error that names the repo
        raise CheckpointError(f"codec {name!r}: download from the hub failed: {type(e).__name__}: {e}") from e


def detect_layout(config: dict, root: Path) -> Layout:
    if config.get("model_type") == "higgs_audio_v2_tokenizer":
        return "hf"
    if "n_q" in config and "ratios" in config:
        return "original"
    raise CheckpointError(f"codec {root}: config.json is neither a transformers-native higgs_audio_v2_tokenizer "
                          f"config nor Boson's original codec config (keys: {sorted(config)[:12]})")


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; CheckpointError naming it when unreadable or corrupt."""
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except OSError as e:
        raise CheckpointError(f"codec {file}: cannot read: {os_error_message(e)}") from e
    except Exception as e:  # safetensors raises SafetensorError (an Exception) on a corrupt or truncated file
        raise CheckpointError(f"codec {file}: cannot read as safetensors: {e}") from e


def _read_safetensors(root: Path) -> dict[str, torch.Tensor]:
    single, index = root / "model.safetensors", root / "model.safetensors.index.json"
    if single.is_file():
        return _load_safetensors(single)
    if index.is_file():
        state: dict[str, torch.Tensor] = {}
        for shard in dict.fromkeys(read_weight_map(index).values()):
            path = shard_path(root, shard, index)
            if not path.is_file():
                raise CheckpointError(f"codec {root}: shard {shard} named in the index is missing")
            state.update(_load_safetensors(path))
        return state
    raise CheckpointError(f"codec {root}: no model.safetensors (or index) found")


def load_codec(path_or_hub: str | Path = DEFAULT_HUB_ID, device: str | torch.device = "cpu",
               with_encoder: bool | None = None) -> Codec:
    """Load a codec directory (either layout) or hub repo; fp32 on `device`."""
    root = resolve_codec_dir(path_or_hub)
    cfg_path = root / "config.json"
    config = read_json_file(cfg_path, missing=f"codec {root}: config.json is missing")
    if not isinstance(config, dict):
        raise CheckpointError(f"codec {cfg_path}: must hold a JSON object, got {type(config).__name__}")
    layout = detect_layout(config, root)
    try:
        cfg = CodecConfig.from_hf_dict(config) if layout == "hf" else CodecConfig.from_original_dict(config)
    except ConfigError as e:
        raise CheckpointError(f"codec {cfg_path}: {e}") from e
    if layout == "hf":
        state = _read_safetensors(root)
    else:
        pth = root / "model.pth"
        if not pth.is_file():
            raise CheckpointError(f"codec {root}: model.pth is missing")
        try:
            state = torch.load(pth, map_location="cpu", weights_only=True)
        except OSError as e:
            raise CheckpointError(f"codec {pth}: cannot read: {os_error_message(e)}") from e
        except Exception as e:  # unpickling errors come in many types; all mean "not a plain state dict"
            raise CheckpointError(f"codec {pth}: cannot read as a tensor state dict: {e}") from e
        if not isinstance(state, Mapping):
            raise CheckpointError(f"codec {pth}: expected a state dict, got {type(state).__name__}")
    return codec_from_state_dict(state, cfg, layout=layout, device=device, with_encoder=with_encoder)
