"""`higgs-stream make-checkpoint OUT --arch v3`: a random-weight Higgs Audio v3 checkpoint.

Written in the real v3 layout (checkpoint.py): config.json (model_type
"higgs_multimodal_qwen3"), the talker tensors under `body.*` / `tied.*` and the codec bundled in
the same safetensors files under `tied.embedding.modality_embeddings.0.model.` (the tensors of a
seeded transformers `HiggsAudioV2TokenizerModel`, engine/codec/make.py), sharded like the v2
writer, plus a tokenizer holding the v3 special tokens.

Tokenizer: byte-level BPE trained here (engine/checkpoint_writer.CORPUS), padded with filler ids, then the
added tokens. "full" follows Qwen3's layout: BPE ids 0..151642, Qwen3's 26 specials at
151643..151668 (`<|endoftext|>` first), then the Higgs ones; of those only `<|audio_end|>` =
151671 is known from peers, the other ids are ours (config._FULL_PRESET_IDS). "tiny": BPE
0..287, the 7 v3 tokens at 288.. (V3SpecialTokens.consecutive(288), TalkerV3Config.tiny()).

Weights come from checkpoint_writer.random_tensor (one generator per (seed, key)). The "tiny"
preset is fp32 and records its shrunken codec in config.json's extension key
`audio_codec_config`; "full" is bf16 (about 8 GB) with the released codec's architecture and no
extension key, exactly like the real file. Never present audio from these weights as speech.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from higgs_stream.engine.checkpoint_files import CONFIG_FILE
from higgs_stream.engine.checkpoint_writer import (
    PRESETS,
    check_seed,
    empty_output_dir,
    numel,
    random_tensor,
    train_bpe,
    write_json,
    write_shards,
)
from higgs_stream.engine.codec.make import build_reference_model, preset_config
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.models.higgs_v3.checkpoint import CODEC_CONFIG_KEY, CODEC_PREFIX, talker_key_shapes
from higgs_stream.engine.models.higgs_v3.config import V3_SPECIAL_TOKEN_STRINGS, TalkerV3Config

# Qwen3's special tokens at 151643.. (public Qwen3 tokenizer), before the Higgs additions.
QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class PresetV3:
    name: str
    config: TalkerV3Config
    bpe_vocab: int
    added: tuple[str, ...]  # added tokens in id order from bpe_vocab
    dtype: torch.dtype
    init_std: float
    shard_bytes: int


def preset_v3(name: str) -> PresetV3:
    if name == "tiny":
        cfg = TalkerV3Config.tiny()
        added = tuple(V3_SPECIAL_TOKEN_STRINGS.values())  # field order = consecutive(288)
        return PresetV3("tiny", cfg, 288, added, torch.float32, 0.1, 2_000_000)
    if name == "full":
        cfg = TalkerV3Config.full()
        higgs = ("<|tts|>", "<|text|>", "<|audio_end|>", "<|audio|>", "<|ref_audio|>", "<|ref_text|>")
        return PresetV3("full", cfg, 151643, QWEN3_SPECIALS + higgs, torch.bfloat16, 0.02, 5_000_000_000)
    raise ConfigError(f"unknown preset {name!r}; expected one of {PRESETS}")


# ------------------------------------------------------------------------------ tokenizer
def build_v3_tokenizer(bpe_vocab: int, added: tuple[str, ...]) -> Tokenizer:
    """Byte-level BPE with exactly `bpe_vocab` ids, then `added` as special tokens in order."""
    tok = train_bpe(bpe_vocab)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    assert tok.token_to_id(added[0]) == bpe_vocab, "added tokens must start right after the BPE vocab"
    return tok


def write_v3_tokenizer(out: Path, p: PresetV3) -> None:
    build_v3_tokenizer(p.bpe_vocab, p.added).save(str(out / "tokenizer.json"))
    entry = dict(lstrip=False, normalized=False, rstrip=False, single_word=False, special=True)
    eos = "<|endoftext|>"
    write_json(out / "tokenizer_config.json", {
        "added_tokens_decoder": {str(p.bpe_vocab + i): {"content": t, **entry} for i, t in enumerate(p.added)},
        "bos_token": None, "eos_token": eos, "pad_token": eos, "model_max_length": p.config.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
    })
    token = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    write_json(out / "special_tokens_map.json", {"eos_token": {"content": eos, **token},
                                                  "pad_token": {"content": eos, **token}})


# -------------------------------------------------------------------------------- weights
def codec_tensors(preset: str, seed: int) -> dict[str, torch.Tensor]:
    """The bundled codec: a seeded random transformers codec's state dict, keys under CODEC_PREFIX."""
    model = build_reference_model(preset_config(preset), seed)  # type: ignore[arg-type]
    return {CODEC_PREFIX + k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}


def make_checkpoint_v3(out: str | Path, preset: str = "tiny", seed: int = 0, *, shard_bytes: int | None = None) -> Path:
    """Write a random-weight v3 checkpoint to `out` (missing or an empty directory); returns it."""
    p = preset_v3(preset)
    check_seed(seed)
    out = empty_output_dir(out)
    cfg = p.config
    assert cfg.special is not None
    config = {**cfg.to_hf_dict(), "dtype": _DTYPE_NAMES[p.dtype], "transformers_version": "4.57.1"}
    if preset == "tiny":
        config[CODEC_CONFIG_KEY] = preset_config("tiny").to_hf_dict()
    write_json(out / CONFIG_FILE, config)
    write_json(out / "generation_config.json", {
        "eos_token_id": list(cfg.special.stop_ids), "pad_token_id": cfg.special.end_of_text,
        "do_sample": True, "temperature": 1.0, "top_k": 50, "top_p": 0.95,
    })
    write_v3_tokenizer(out, p)

    talker = list(talker_key_shapes(cfg).items())
    codec = codec_tensors(preset, seed)
    elem = torch.empty((), dtype=p.dtype).element_size()
    sizes = [elem * numel(shape) for _, shape in talker] + [t.numel() * t.element_size() for t in codec.values()]
    plan: list[tuple[str, object]] = [(k, s) for k, s in talker] + list(codec.items())

    def write(path: Path, items: list[tuple[str, object]]) -> list[str]:
        tensors = {key: (value if isinstance(value, torch.Tensor)
                         else random_tensor(key, value, seed, p.init_std, p.dtype)) for key, value in items}
        save_file(tensors, str(path), metadata={"format": "pt"})
        return list(tensors)

    write_shards(out, plan, sizes, shard_bytes or p.shard_bytes, write)
    return out
