"""Shared fixtures: tiny random-weight checkpoints written by `make-checkpoint` (seed 0).

The v2 ones hold the talker, the text tokenizer and the codec (`<dir>/audio_tokenizer`), exactly
as `higgs-stream make-checkpoint DIR --preset tiny --layout hf|original --seed 0` writes them; the
v3 one is `make-checkpoint DIR --arch v3 --preset tiny --seed 0` (codec bundled in the weights);
the Qwen3-TTS one `make-checkpoint DIR --arch qwen3-tts --preset tiny --seed 0` (CustomVoice).
Session-scoped and read-only: copy a checkpoint before modifying it. `interpret`: a script run under Triton's
interpreter, `compile_for_hopper`: a Triton kernel compiled for sm_90 without a GPU (the kernel tests, and any test
of a module's Triton launch on the CPU).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from higgs_stream.engine.models.higgs_v2.make_checkpoint import make_checkpoint
from higgs_stream.engine.models.higgs_v3.make_checkpoint import make_checkpoint_v3
from higgs_stream.engine.models.qwen3_tts.make_checkpoint import make_checkpoint_qwen

# Tiny models are dominated by per-op overhead: one intra-op thread is several times faster on
# the 2-core CI machine than two threads fighting each other (and keeps timings steady).
torch.set_num_threads(1)


GPU_TEST_HEADROOM_GB = 48.0  # what an 80 GB H100 leaves a test beside a model; less than cuDNN's wrong plan wanted


@pytest.fixture(autouse=True)
def _gpu_memory_as_a_server_bounds_it():
    """On a GPU each test runs with its process's memory bounded at what it holds plus GPU_TEST_HEADROOM_GB, as a
    server bounds itself (engine/gpu_memory.py): on an idle H200 cuDNN otherwise picks convolution plans by the
    card's free memory, and one with ~80 GB of workspace decoded a Qwen3-TTS convolution wrong; the tests must see
    what a served process sees. A test that starts a pipeline bounds it further; the next test starts over."""
    bounded = torch.cuda.is_available()
    if bounded:
        from higgs_stream.engine.gpu_memory import bound_process_memory

        bound_process_memory(torch.device("cuda", torch.cuda.current_device()), GPU_TEST_HEADROOM_GB)
    yield
    if bounded:
        for i in range(torch.cuda.device_count()):
            torch.cuda.set_per_process_memory_fraction(1.0, i)


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


@pytest.fixture(scope="session")
def tiny_qwen_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3-TTS CustomVoice checkpoint (hub layout, speakers aiden and dylan, stand-in text tokenizer)."""
    return make_checkpoint_qwen(tmp_path_factory.mktemp("ckpt") / "tiny-qwen", "tiny", seed=0)


def _flac_announcing(total_frames: int, sr: int = 48000, channels: int = 2) -> bytes:
    """0.1 s of FLAC (a 440 Hz tone) whose STREAMINFO header claims `total_frames` (36 bits; 0 =
    unknown): a decompression bomb as its header shows it (a real 1 h FLAC of near-silence is
    ~0.7 MB and decodes to 1.3 GB)."""
    import soundfile as sf  # here, not at the top: the GPU machine's tests do not need it (nor have it)

    t = np.arange(sr // 10) / sr
    buf = io.BytesIO()
    sf.write(buf, np.stack([0.5 * np.sin(2 * np.pi * 440 * t)] * channels, axis=1), sr, format="FLAC", subtype="PCM_16")
    data = bytearray(buf.getvalue())
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first, its fields from byte 8
    data[8 + 13] = (data[8 + 13] & 0xF0) | (total_frames >> 32)
    data[8 + 14 : 8 + 18] = (total_frames & 0xFFFFFFFF).to_bytes(4, "big")
    return bytes(data)


@pytest.fixture(scope="session")
def flac_announcing():
    """`flac_announcing(total_frames, sr=48000, channels=2)` -> FLAC bytes whose header lies."""
    return _flac_announcing


# Triton 3.6's interpreter holds scalars as 1-element arrays, and NumPy >= 2.3 refuses int() of one: a loop bounded
# by a loaded value (kernels/paged_decode.py's sequence length) fails there, not on the GPU. Read the element.
INTERPRETER_PRELUDE = r"""
import triton.runtime.interpreter as _ti
_patch_tensor = _ti._patch_lang_tensor
def _index_from_one_element(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_ti._patch_lang_tensor = _index_from_one_element
"""


def run_interpreted(script: str, *args: str, timeout: float = 300) -> Any:
    """Run `script` in a fresh Python under Triton's interpreter (TRITON_INTERPRET must be set before Triton loads)
    and return the JSON of the last line it prints; skips the test without Triton."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", INTERPRETER_PRELUDE + script, *args], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture
def interpret():
    """`run_interpreted`, for the tests of the Triton kernels on the CPU."""
    return run_interpreted


def _compile_for_hopper(kernel, signature: dict[str, str], constexprs: dict, **options):
    """Triton's compile of `kernel` for sm_90 with its bundled ptxas, no GPU needed; pointer arguments
    marked 16-byte aligned, as the launcher specializes torch's allocations. Skips where Triton has no
    CUDA tools."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as exc:  # pragma: no cover - a Triton without its bundled CUDA tools
        if "ptxas" in str(exc):
            pytest.skip(f"no ptxas: {exc}")
        raise


@pytest.fixture
def compile_for_hopper():
    """`_compile_for_hopper` above: a kernel's compile errors show on a CPU-only CI machine."""
    return _compile_for_hopper
