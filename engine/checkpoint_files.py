"""A checkpoint directory on disk, whatever the family: hub resolution, config.json, safetensors
headers, and building a module with its parameters on the meta device.

Every family's loader (`models/<family>/checkpoint.py`) reads its files through these helpers:
headers are checked against the family's key table before a byte of weight data is read, then
tensors stream shard by shard into a module whose parameters start on the meta device.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError
from safetensors import safe_open
from torch import nn

from higgs_stream.engine.config_fields import hf_token_ids
from higgs_stream.engine.errors import CheckpointError, ConfigError

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# What a talker checkpoint needs from a hub repo (fnmatch patterns; none reaches a subfolder).
TALKER_ALLOW_PATTERNS = (
    CONFIG_FILE,
    GENERATION_FILE,
    "model*.safetensors",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# (config.json's `dtype` may name exactly these: config_fields.CONFIG_DTYPES; tests/engine/test_checkpoint_ranges.py)


# --------------------------------------------------------------------------------------- keys
def swap_prefix(key: str, pairs: Iterable[tuple[str, str]]) -> str | None:
    """`key` with the first matching (old, new) prefix pair applied; None when no pair matches."""
    for old, new in pairs:
        if key.startswith(old):
            return new + key[len(old):]
    return None


# ------------------------------------------------------------------------------- model dir
def resolve_model_dir(
    model: str | Path,
    *,
    revision: str | None = None,
    allow_patterns: tuple[str, ...] = TALKER_ALLOW_PATTERNS,
) -> Path:
    """An existing local directory, else a hub repo id fetched with `snapshot_download`.

    The hub download shows huggingface_hub's tqdm progress bar and fetches only
    `allow_patterns`. Offline / unknown repo / bad id all raise CheckpointError.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    text = str(model)
    if path.exists():
        raise CheckpointError(f"model path {text} is not a directory")
    if text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise CheckpointError(f"model {text!r} is neither an existing directory nor a hub id (owner/name)")
    try:
        local = snapshot_download(repo_id=text, revision=revision, allow_patterns=list(allow_patterns))
    except HFValidationError as e:
        raise CheckpointError(f"invalid hub id {text!r}: {e}") from e
    except LocalEntryNotFoundError as e:
        raise CheckpointError(
            f"cannot download {text!r} from the hub and it is not in the local cache (offline?): {e}"
        ) from e
    except HfHubHTTPError as e:
        raise CheckpointError(f"hub download of {text!r} failed (repo missing, gated or no access?): {e}") from e
    except OSError as e:
        raise CheckpointError(f"hub download of {text!r} failed: {e}") from e
    root = Path(local)
    if not (root / CONFIG_FILE).is_file():
        raise CheckpointError(f"hub repo {text!r} has no {CONFIG_FILE}; is it a Higgs talker checkpoint?")
    return root


# ------------------------------------------------------------------------------ inspection
@dataclass(frozen=True)
class TensorEntry:
    """One checkpoint tensor: where it lives and what the header says about it."""

    file: Path
    stored_key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def os_error_message(e: OSError) -> str:
    """What went wrong opening a file, in words: permission denied is not a missing file."""
    if isinstance(e, PermissionError):
        return "permission denied"
    if isinstance(e, FileNotFoundError):
        return "no such file"
    if isinstance(e, IsADirectoryError):
        return "is a directory"
    return e.strerror or str(e)


def read_json_file(file: Path, missing: str | None = None) -> Any:
    """The JSON value in `file` (UTF-8); CheckpointError naming the file when it is missing (message
    `missing`, if given), unreadable (permission denied says so), not UTF-8 or not JSON (nested too deeply too)."""
    try:
        text = file.read_bytes().decode("utf-8")
    except (FileNotFoundError, IsADirectoryError) as e:
        raise CheckpointError(missing or f"cannot read {file}: {os_error_message(e)}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {os_error_message(e)}") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"cannot read {file}: not UTF-8 text ({e})") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"cannot read {file}: not JSON ({e})") from e
    except RecursionError as e:  # the parser's stack, on arrays nested thousands deep
        raise CheckpointError(f"cannot read {file}: not JSON (nested too deeply)") from e


def read_config_json(root: Path) -> dict[str, Any]:
    """A checkpoint directory's config.json (either family); CheckpointError when missing or unreadable."""
    file = root / CONFIG_FILE
    raw = read_json_file(file, missing=f"missing {CONFIG_FILE} in {root}")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def read_generation_config(root: Path, vocab_size: int | None = None,
                           table: str = "config.json vocab_size") -> dict[str, Any] | None:
    """A checkpoint directory's generation_config.json, None when it has none (the file only holds defaults).
    When present it is read as strictly as config.json: CheckpointError naming the file when it is unreadable, not
    JSON or not a JSON object, or (given the text `vocab_size`, `table` naming it) when its bos/eos/pad_token_id
    is not an id of that vocabulary (engine/config_fields.py, `hf_token_ids`)."""
    file = root / GENERATION_FILE
    if not file.exists() and not file.is_symlink():
        return None
    raw = read_json_file(file)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    if vocab_size is not None:
        try:
            hf_token_ids(raw, "", vocab_size, table)
        except ConfigError as e:
            raise CheckpointError(f"{file}: {e}") from e
    return raw


def shard_path(root: Path, name: Any, source: Path) -> Path:
    """`root / name` for a shard file name listed in `source`; CheckpointError unless it is a
    relative path that stays inside `root` (symlinks resolved)."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{source}: a shard file name must be a non-empty string, got {name!r}")
    if Path(name).is_absolute():
        raise CheckpointError(f"{source}: shard path {name!r} is absolute; shards must lie in the checkpoint directory")
    path = root / name
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise CheckpointError(f"{source}: cannot resolve shard path {name!r}: {e}") from e
    if not resolved.is_relative_to(root.resolve()):
        raise CheckpointError(f"{source}: shard path {name!r} resolves outside the checkpoint directory {root}")
    return path


def read_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a model.safetensors.index.json: tensor name -> shard file name (strings)."""
    raw = read_json_file(index)
    if not isinstance(raw, dict) or "weight_map" not in raw:
        raise CheckpointError(f"cannot read weight_map from {index}: no 'weight_map' object")
    weight_map = raw["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise CheckpointError(f"{index}: weight_map must be a JSON object of tensor name -> shard file, "
                              f"got {type(weight_map).__name__}")
    return weight_map


def weight_files(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """Safetensors files of the checkpoint and the index weight map (None for a single file)."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = read_weight_map(index)
        files = [shard_path(root, name, index) for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"missing shard file {f.name} (listed in {INDEX_FILE}) in {root}")
        return files, weight_map
    single = root / SINGLE_WEIGHTS_FILE
    if single.is_file():
        return [single], None
    try:
        others = sorted(p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pth", ".pt"))
    except OSError as e:
        raise CheckpointError(f"cannot list the checkpoint directory {root}: {os_error_message(e)}") from e
    raise CheckpointError(
        f"no {SINGLE_WEIGHTS_FILE} or {INDEX_FILE} in {root}"
        + (f" (found {others}; only safetensors with the standard names are supported)" if others else "")
    )


def read_headers(files: list[Path], weight_map: dict[str, str] | None) -> dict[str, TensorEntry]:
    """Stored key -> entry for every tensor of every file (headers only, no data)."""
    entries: dict[str, TensorEntry] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    view = f.get_slice(key)
                    dtype_name = view.get_dtype()
                    if dtype_name not in _FLOAT_DTYPES:
                        raise CheckpointError(f"{file.name}: tensor {key} has unsupported dtype {dtype_name}")
                    if key in entries:
                        raise CheckpointError(f"tensor {key} appears in both {entries[key].file.name} and {file.name}")
                    entries[key] = TensorEntry(file, key, tuple(view.get_shape()), _FLOAT_DTYPES[dtype_name])
        except CheckpointError:
            raise
        except OSError as e:
            raise CheckpointError(f"cannot read safetensors header of {file}: {os_error_message(e)}") from e
        except Exception as e:  # safetensors raises SafetensorError (an Exception) on corrupt headers
            raise CheckpointError(f"cannot read safetensors header of {file}: {e}") from e
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in entries:
                raise CheckpointError(f"{INDEX_FILE} lists tensor {key} in {name}, but no shard contains it")
            if entries[key].file.name != name:
                raise CheckpointError(f"{INDEX_FILE} lists tensor {key} in {name}, but it is in {entries[key].file.name}")
        unlisted = [k for k in entries if k not in weight_map]
        if unlisted:
            raise CheckpointError(f"tensor {unlisted[0]} (in {entries[unlisted[0]].file.name}) is not listed in {INDEX_FILE}")
    return entries


def layers_held(keys: Iterable[str], prefix: str) -> int:
    """How many layers the keys `{prefix}{i}.*` hold: one more than the largest index i (0: none)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    indices = [int(m.group(1)) for m in map(pattern.match, keys) if m]
    return max(indices) + 1 if indices else 0


def check_layer_count(claimed: int, keys: Iterable[str], prefix: str, field: str, source: Path | str,
                      what: str = "layers", *, exact: bool = True) -> None:
    """The config's layer count `claimed` (config field `field`) must be the number of layers the
    files hold (`exact` False: at most that many). Checked before anything is built per layer, so an
    absurd count fails here instead of building a billion modules."""
    held = layers_held(keys, prefix)
    if claimed > held or (exact and claimed != held):
        found = f"{held} {what} ({prefix}0..{held - 1})" if held else f"no {prefix}* tensors"
        raise CheckpointError(f"{source}: {field} is {claimed}, but the weight files hold {found}")


# --------------------------------------------------------------------------------- loading
def read_tensors(entries: Mapping[str, TensorEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every entry (`name`: the caller's key for it), one file open at a time,
    files in the order of their first entry; each tensor as stored (its dtype) on the CPU."""
    by_file: dict[Path, list[tuple[str, TensorEntry]]] = {}
    for name, entry in entries.items():
        by_file.setdefault(entry.file, []).append((name, entry))
    for file, items in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name, entry in items:
                yield name, f.get_tensor(entry.stored_key)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get meta parameters (no memory, no init) and real buffers.

    Buffers (RoPE tables, codebook offsets) are derived from the config and absent from
    checkpoints, so they must be computed for real; parameters are filled from the files.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def check_keys(want: dict[str, torch.Tensor], stored: dict, prefix: str, source: str) -> None:
    """CheckpointError naming the first missing, unexpected or mis-shaped tensor (names under `prefix`);
    `stored` maps names to anything with a `.shape`."""
    for kind, names in (("missing", sorted(set(want) - set(stored))), ("unexpected", sorted(set(stored) - set(want)))):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise CheckpointError(f"{source}: {kind} tensor {prefix}{names[0]}{more}")
    for name, t in want.items():
        if tuple(stored[name].shape) != tuple(t.shape):
            raise CheckpointError(f"{source}: tensor {prefix}{name} has shape {tuple(stored[name].shape)}, the config "
                                  f"gives {tuple(t.shape)}")
