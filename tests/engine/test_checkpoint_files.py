"""The shared checkpoint-file helpers: JSON files, the index weight map, shard confinement, layer counts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from higgs_stream.engine.checkpoint_files import (
    INDEX_FILE,
    check_layer_count,
    read_config_json,
    read_json_file,
    weight_files,
)
from higgs_stream.engine.errors import CheckpointError
from higgs_stream.engine.models.higgs_v2.make_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sharded talker-only tiny v2 checkpoint to copy and break."""
    return make_checkpoint(tmp_path_factory.mktemp("plain") / "hf", "tiny", "hf", seed=0, codec=False)


def _raises(match: str):
    return pytest.raises(CheckpointError, match=match)


def test_errors_are_typed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with _raises(r"cannot read .*config.json: not UTF-8 text") as e:
        read_config_json(tmp_path)
    assert e.value.code == "checkpoint"


def test_permission_denied_is_not_a_missing_file(tmp_path: Path, monkeypatch) -> None:
    """(As root chmod 000 does not deny a read, so the OS error is injected.)"""
    file = tmp_path / "config.json"
    file.write_text("{}")

    def denied(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with _raises(r"cannot read .*config.json: permission denied"):
        read_config_json(tmp_path)
    with _raises(r"cannot read .*other.json: permission denied"):
        read_json_file(tmp_path / "other.json")


def test_missing_config_still_says_missing(tmp_path: Path) -> None:
    with _raises(f"missing config.json in {tmp_path}"):
        read_config_json(tmp_path)


@pytest.mark.parametrize("index,match", [
    ({"weight_map": [1, 2]}, "weight_map must be a JSON object of tensor name -> shard file, got list"),
    ({}, "no 'weight_map' object"),
    ({"weight_map": {"model.norm.weight": 5}}, "a shard file name must be a non-empty string, got 5"),
    ({"weight_map": {"model.norm.weight": "../../../../etc/passwd"}}, "'../../../../etc/passwd' resolves outside"),
    ({"weight_map": {"model.norm.weight": "/etc/passwd"}}, "'/etc/passwd' is absolute"),
    ({"weight_map": {"model.norm.weight": "sub/../../x.safetensors"}}, "resolves outside"),
])
def test_weight_map_is_checked_and_confined(plain: Path, tmp_path: Path, index, match) -> None:
    d = shutil.copytree(plain, tmp_path / "c")
    (d / INDEX_FILE).write_text(json.dumps(index))
    with _raises(match):
        weight_files(d)


def test_shard_symlink_out_of_the_directory_is_rejected(plain: Path, tmp_path: Path) -> None:
    d = shutil.copytree(plain, tmp_path / "c")
    outside = tmp_path / "outside.safetensors"
    shard = d / "model-00002-of-00004.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with _raises("resolves outside the checkpoint directory"):
        weight_files(d)


def test_layer_count_must_match_the_files() -> None:
    keys = ["model.layers.0.a", "model.layers.1.a", "model.norm.weight"]
    check_layer_count(2, keys, "model.layers.", "num_hidden_layers", "config.json")
    with _raises(r"config.json: num_hidden_layers is 1000000000, but the weight files hold 2 layers"):
        check_layer_count(10**9, keys, "model.layers.", "num_hidden_layers", "config.json")
    with _raises("hold no model.layers.\\* tensors"):
        check_layer_count(1, ["x"], "model.layers.", "num_hidden_layers", "config.json")
    check_layer_count(1, keys, "model.layers.", "n", "config.json", exact=False)  # fewer is allowed then


def test_shard_symlink_loop_is_a_checkpoint_error(plain: Path, tmp_path: Path) -> None:
    d = shutil.copytree(plain, tmp_path / "c")
    shard = d / "model-00002-of-00004.safetensors"
    shard.unlink()
    shard.symlink_to(shard)
    with _raises("cannot resolve shard path 'model-00002-of-00004.safetensors'"):
        weight_files(d)
