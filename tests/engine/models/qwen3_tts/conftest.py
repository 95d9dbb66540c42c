"""Shared fixtures of the Qwen3-TTS tests: the reference fixtures that scripts/qwen3_reference_fixtures.py
writes with the official PyPI qwen-tts 0.1.1 (a tiny random checkpoint in the hub layout, bf16, and
the reference's outputs in reference.npz)."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch.nn.functional as F
from higgs_stream.engine.models.qwen3_tts.checkpoint import load_model
from higgs_stream.engine.models.qwen3_tts.policy import ASSISTANT, INSTRUCTION, REFERENCE

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


@pytest.fixture(scope="module")
def model(tiny_dir):
    """The tiny checkpoint's talker and code predictor, fp32."""
    return load_model(tiny_dir)


class IdTokenizer:
    """The fixtures' token ids by template string (the fixtures hold ids, not text)."""

    special = None

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table

    def encode(self, text: str) -> list[int]:
        return list(self.table[text])


@pytest.fixture(scope="module")
def tokenizer(ref) -> IdTokenizer:
    """Texts "A" and "B", instruction "I", reference transcript "R" -> the reference's own prompt ids."""
    return IdTokenizer({ASSISTANT.format("A"): ref["scenario_text_a"].tolist(),
                        ASSISTANT.format("B"): ref["scenario_text_b"].tolist(),
                        INSTRUCTION.format("I"): ref["scenario_instruct"].tolist(),
                        REFERENCE.format("R"): ref["clone_ref_ids"].tolist()})


def _copied_heads(q, k_cache, v_cache, t, s, hq, hkv, d):
    """The code predictor's frame attention in its plain form: every query head gets its own copy of
    its K/V head (q [B t, Hq, D], buffers [B, 16, Hkv, D] -> [B t, Hq, D])."""
    b = k_cache.shape[0]
    q = q.view(b, t, hq, d).transpose(1, 2)
    k, v = (c[:, :s].transpose(1, 2).repeat_interleave(hq // hkv, dim=1) for c in (k_cache, v_cache))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=d**-0.5)
    return o.transpose(1, 2).reshape(b * t, hq, d)


@pytest.fixture(scope="session")
def copied_heads():
    return _copied_heads
