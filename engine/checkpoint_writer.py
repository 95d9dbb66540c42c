"""`higgs-stream make-checkpoint`: write a random-weight checkpoint of any family in its real on-disk layout.

No machine here reaches the model hub, so the loaders are tested on checkpoints written here in
the real on-disk layouts (SPEC "Weights on these machines"). Each family writes its own files
(`models/<family>/make_checkpoint.py`, reached through the registry by `--arch`); what they share
is here: a byte-level BPE trained on a built-in English snippet, seeded random tensors (one
generator per (seed, tensor name): a tensor's values do not depend on the layout, the shard size or
the order of writing), shard planning, and a safetensors writer that streams one tensor at a time.
Never present audio from these weights as speech.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from higgs_stream.engine.checkpoint_files import INDEX_FILE, SINGLE_WEIGHTS_FILE
from higgs_stream.engine.errors import ConfigError

PRESETS = ("tiny", "full")


# ------------------------------------------------------------------------------ tokenizer
# A built-in training text (written for this project) so the BPE has real English merges.
CORPUS = """\
The quick brown fox jumps over the lazy dog while the morning train rolls into the station.
She said, "Good morning! How are you today?" and he answered that he was fine, thank you.
Streaming speech starts to play before the whole sentence has been generated, one small
chunk at a time, so the listener hears the first word within a fraction of a second.
On Tuesday, March 3rd, the temperature reached 21 degrees; by evening it had fallen to 12.
Please call me back at 555-0142 or send an e-mail before 5:30 in the afternoon.
Numbers like 1, 2, 3, 10, 100, 2024 and 3.14159 appear in text more often than you think.
It's a beautiful day, isn't it? We're going to the park, and they'll meet us there later.
The model reads the text, thinks about the voice, and then speaks the words out loud.
Music, laughter, applause and quiet rooms all sound different; a good voice keeps its tone.
When the network is slow, the server must never stop in the middle of a word.
Artificial voices should sound natural, clear and warm, with pauses where a person breathes.
A long story is read paragraph by paragraph, and every paragraph keeps the same speaker.
Questions rise at the end? Statements fall. Exclamations are loud! Whispers are soft...
The engineers measured latency, throughput and the time to the first audio packet.
Hello world. Hello again, world. Goodbye for now, and see you tomorrow at nine o'clock.
"""

# Llama-3's pre-tokenizer split pattern (public tokenizer.json of Llama 3).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_bpe(bpe_vocab: int) -> Tokenizer:
    """Byte-level BPE (Llama-3 pre-tokenizer) trained on CORPUS, padded to exactly `bpe_vocab` ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trained_size = min(bpe_vocab, 512)  # merges the snippet can support; the rest is filler
    trainer = trainers.BpeTrainer(vocab_size=trained_size, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return pad_vocab(tok, bpe_vocab)


def pad_vocab(tok: Tokenizer, size: int) -> Tokenizer:
    """Fill BPE ids up to `size` with filler tokens that no merge produces (`<filler_N>`)."""
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    assert len(vocab) <= size, f"trained BPE has {len(vocab)} ids, more than the {size} reserved"
    next_id = len(vocab)
    n = 0
    while next_id < size:
        filler = f"<filler_{n}>"  # printable ASCII: its own byte-level spelling, decodes as-is
        n += 1
        if filler in vocab:
            continue
        vocab[filler] = next_id
        next_id += 1
    return Tokenizer.from_str(json.dumps(spec))


# -------------------------------------------------------------------------------- weights
def random_tensor(key: str, shape: tuple[int, ...], seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    """The seeded random value of one tensor (depends only on seed, key, shape, std, dtype)."""
    check_seed(seed)
    # torch's CPU generator keeps only 32 bits of its seed: hash (seed, key) into 32 bits.
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if key.endswith("norm.weight"):
        return (1.0 + 0.1 * noise).to(dtype)
    return (noise * std).to(dtype)


def check_seed(seed: int) -> None:
    if not (isinstance(seed, int) and 0 <= seed < 2**31):
        raise ConfigError(f"seed must be an int in [0, 2**31), got {seed!r}")


def shard_layout(sizes: list[int], limit: int) -> list[int]:
    """Shard index of each tensor: fill in order, open a new shard when the next one overflows."""
    out, shard, used = [], 0, 0
    for size in sizes:
        if used > 0 and used + size > limit:
            shard, used = shard + 1, 0
        out.append(shard)
        used += size
    return out


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                      tensors: Iterator[torch.Tensor]) -> None:
    """Stream one safetensors file: the header from `entries`, then each tensor as it is made.

    Same format as `safetensors.torch.save_file` (u64 header length, JSON header padded to 8
    bytes, raw little-endian data), but only one tensor is in memory at a time.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = numel(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, shape, dtype), t in zip(entries, tensors, strict=True):
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, f"{name}: made {t.dtype} {tuple(t.shape)}"
            f.write(t.contiguous().view(torch.uint8).numpy().data)
        assert f.tell() == 8 + len(blob) + offset, f"{path}: wrote {f.tell()} bytes, header promises {offset}"


def write_shards(out: Path, plan: list[tuple[str, Any]], sizes: list[int], shard_bytes: int,
                 write: Callable[[Path, list[tuple[str, Any]]], Iterable[str]]) -> list[str]:
    """Write `plan` (one (key, item) per tensor, `sizes[i]` its bytes) as one `model.safetensors`, or as
    `model-0000i-of-0000n.safetensors` shards of at most `shard_bytes` (HF semantics: a bigger tensor
    gets a shard of its own) plus `model.safetensors.index.json`. `write(path, items)` writes one file
    of the items in order and returns the keys it stored there. Returns the file names, in order."""
    shards = shard_layout(sizes, shard_bytes)
    n = shards[-1] + 1
    names = [SINGLE_WEIGHTS_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    for shard_idx, items in group_by_shard(plan, shards):
        weight_map.update(dict.fromkeys(write(out / names[shard_idx], items), names[shard_idx]))
    if n > 1:
        write_json(out / INDEX_FILE, {"metadata": {"total_size": sum(sizes)},
                                       "weight_map": dict(sorted(weight_map.items()))})
    return names


def group_by_shard(plan: list[tuple[str, tuple[int, ...]]], shards: list[int]) -> Iterator[tuple[int, list]]:
    current: list = []
    for i, item in enumerate(plan):
        if current and shards[i] != shards[i - 1]:
            yield shards[i - 1], current
            current = []
        current.append(item)
    yield shards[-1], current


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def empty_output_dir(out: str | Path) -> Path:
    """`out`, created with its parents when missing; ConfigError when it exists and is not an empty
    directory (a checkpoint is never written over another)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {out} exists and is not an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


# ------------------------------------------------------------------------------ the command
def write_checkpoint(out: str | Path, arch: str | None = None, preset: str = "tiny", layout: str | None = None,
                     seed: int = 0) -> Path:
    """`make-checkpoint`: a random-weight checkpoint of the family `arch` (the registry's default
    family when None) in `layout` (the family's first layout when None). Nothing is written when
    an argument is refused."""
    from higgs_stream.engine.models.registry import DEFAULT_ARCH, family_named

    family = family_named(arch or DEFAULT_ARCH)
    layout = layout or family.layouts[0]
    if layout not in family.layouts:
        if len(family.layouts) == 1:
            raise ConfigError(f"--layout {layout!r}: {family.arch} checkpoints have one layout; "
                              f"drop --layout for --arch {family.arch}")
        raise ConfigError(f"unknown layout {layout!r}; expected one of {family.layouts}")
    presets = getattr(family, "presets", PRESETS)  # a family may name its released sizes
    if preset not in presets:
        raise ConfigError(f"unknown preset {preset!r}; expected one of {presets}")
    check_seed(seed)
    return family.make_checkpoint(out, preset, layout, seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from higgs_stream.engine.models.registry import DEFAULT_ARCH, FAMILIES

    layouts = sorted({layout for f in FAMILIES for layout in f.layouts})
    parser.add_argument("out", type=Path, help="output directory (missing or empty)")
    parser.add_argument("--arch", choices=[f.arch for f in FAMILIES], default=DEFAULT_ARCH,
                        help="; ".join(f"{f.arch}: {f.summary}" for f in FAMILIES))
    presets = sorted({p for f in FAMILIES for p in getattr(f, "presets", PRESETS)}, key=lambda p: (p not in PRESETS, p))
    parser.add_argument("--preset", choices=presets, default="tiny",
                        help="tiny: CPU-test size; full: the released architecture (v2 3B ~11.5 GB, v3 4B ~8 GB bf16); "
                             "qwen3-tts: CustomVoice, or the suffix -base (voice cloning) / -design (VoiceDesign)")
    parser.add_argument("--layout", choices=layouts, default=None,
                        help="on-disk layout (default: the family's first); "
                             + "; ".join(f"{f.arch}: {', '.join(f.layouts)}" for f in FAMILIES))
    parser.add_argument("--seed", type=int, default=0, help="weight seed (0 <= seed < 2**31)")


def run(args: argparse.Namespace) -> int:
    from higgs_stream.engine.models.registry import family_named

    try:
        out = write_checkpoint(args.out, arch=args.arch, preset=args.preset, layout=args.layout, seed=args.seed)
    except OSError as e:  # a folder that cannot be made (/proc/x, under a file): a traceback before (a probe)
        raise ConfigError(f"cannot write a checkpoint to {args.out}: {e.strerror or e}") from e
    family = family_named(args.arch)
    layout = f", {args.layout or family.layouts[0]} layout" if len(family.layouts) > 1 else ""
    print(f"wrote random-weight {args.preset} {args.arch} checkpoint (seed {args.seed}{layout}) to {out}")
    return 0
