"""Shared fixtures: tiny random-weight checkpoints written by `make-checkpoint` (seed 0).

The v2 ones hold the talker, the text tokenizer and the codec (`<dir>/audio_tokenizer`), exactly
as `higgs-stream make-checkpoint DIR --preset tiny --layout hf|original --seed 0` writes them; the
v3 one is `make-checkpoint DIR --arch v3 --preset tiny --seed 0` (codec bundled in the weights).
Session-scoped and read-only: copy a checkpoint before modifying it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from higgs_stream.engine.make_checkpoint import make_checkpoint
from higgs_stream.engine.make_checkpoint_v3 import make_checkpoint_v3

# Tiny models are dominated by per-op overhead: one intra-op thread is several times faster on
# the 2-core CI machine than two threads fighting each other (and keeps timings steady).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny checkpoint in the transformers-native ("hf") layout."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-hf", preset="tiny", layout="hf", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny checkpoint in Boson's original layout (same tensors as `tiny_ckpt`)."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-original", preset="tiny", layout="original",
                           seed=0)


@pytest.fixture(scope="session")
def tiny_v3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Higgs Audio v3 checkpoint (Qwen3 talker, codec bundled under the v3 prefix)."""
    return make_checkpoint_v3(tmp_path_factory.mktemp("ckpt") / "tiny-v3", preset="tiny", seed=0)
