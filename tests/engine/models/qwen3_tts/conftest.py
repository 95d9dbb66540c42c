"""Shared fixtures of the Qwen3-TTS tests: the reference fixtures that scripts/qwen3_reference_fixtures.py
writes with the official PyPI qwen-tts 0.1.1 (a tiny random checkpoint in the hub layout, bf16, and
the reference's outputs in reference.npz)."""

import shutil
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return FIXTURES / "tiny"


@pytest.fixture(scope="session")
def ref() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "reference.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory, tiny_dir) -> Path:
    """The tiny Base checkpoint (fixtures/tiny_base: talker + speaker encoder) with tiny's speech_tokenizer
    (the fixtures keep one copy of it)."""
    root = tmp_path_factory.mktemp("qwen") / "tiny_base"
    shutil.copytree(FIXTURES / "tiny_base", root)
    shutil.copytree(tiny_dir / "speech_tokenizer", root / "speech_tokenizer")
    return root
