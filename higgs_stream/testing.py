"""What "equal" means for audio here, as checks shared by the tests and the benchmarks.

Streamed audio equals the one-shot decode of the whole utterance to fp32 rounding, not bit for
bit: a BLAS/conv kernel sums a window and a whole utterance (or a batch of 3 and a batch of 1) in
different orders, and which kernel it picks depends on the shape, the CPU vendor and the thread
count. So the bounds are stated, and tight enough that a real seam (a window missing one frame of
left context) fails them by orders of magnitude:

- float audio: max |got - want| <= EXACT_REL_TO_PEAK * max |want|  (measured: ~1e-6 and below);
- s16le PCM: equal length and at most PCM_MAX_LSB step apart at every sample (rounding to s16
  can land either side of a .5 boundary when the float differs in its last bits).
"""

from __future__ import annotations

import numpy as np

EXACT_REL_TO_PEAK = 1e-5
PCM_MAX_LSB = 1


def rel_to_peak(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (0.0 for two silent signals); shapes must match."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shapes differ: {got.shape} vs {want.shape}"
    if got.size == 0:
        return 0.0
    peak = float(np.abs(want).max())
    diff = float(np.abs(got - want).max())
    return diff / peak if peak > 0 else diff


def assert_audio_close(got: np.ndarray, want: np.ndarray, bound: float = EXACT_REL_TO_PEAK, what: str = "") -> float:
    """Float audio equal to fp32 rounding: max |Δ| <= bound × peak. Returns the measured ratio."""
    err = rel_to_peak(got, want)
    assert err <= bound, f"{what}: max |Δ| = {err:.3g} of peak > {bound:g}"
    return err


def pcm_max_lsb(got: bytes, want: bytes) -> int:
    """Largest per-sample difference between two s16le buffers of equal length, in LSB."""
    assert len(got) == len(want), f"PCM lengths differ: {len(got) // 2} vs {len(want) // 2} samples"
    a = np.frombuffer(got, "<i2").astype(np.int32)
    b = np.frombuffer(want, "<i2").astype(np.int32)
    return int(np.abs(a - b).max()) if a.size else 0


def assert_pcm_close(got: bytes, want: bytes, max_lsb: int = PCM_MAX_LSB, what: str = "") -> int:
    """s16le PCM of equal length, every sample within `max_lsb`. Returns the measured max."""
    lsb = pcm_max_lsb(got, want)
    assert lsb <= max_lsb, f"{what}: PCM differs by up to {lsb} LSB (> {max_lsb})"
    return lsb


def check_tensors_are_named(weights_file, load, missing: str, unexpected: str, misshaped: str,
                            bad_shape: tuple[int, ...]) -> dict:
    """A checkpoint's safetensors file rewritten three times, each time `load()` raising a CheckpointError
    that names the tensor: `missing` left out ("missing tensor ..."), `unexpected` added ("unexpected
    tensor ..."), `misshaped` given `bad_shape` ("... has shape"). The file is restored after; returns
    its tensors (the loaders' shared key check, engine/checkpoint_files.check_keys, seen from each)."""
    import pytest
    import torch
    from higgs_stream.engine.errors import CheckpointError
    from safetensors.torch import load_file, save_file

    weights = load_file(weights_file)
    cases = [({k: v for k, v in weights.items() if k != missing}, f"missing tensor {missing}"),
             ({**weights, unexpected: torch.zeros(2)}, f"unexpected tensor {unexpected}"),
             ({**weights, misshaped: torch.zeros(bad_shape)}, f"{misshaped} has shape")]
    try:
        for tensors, message in cases:
            save_file(tensors, weights_file)
            with pytest.raises(CheckpointError, match=message):
                load()
    finally:
        save_file(weights, weights_file)
    return weights


async def collect(handle, timeout: float = 60.0) -> tuple[bytes, object]:
    """A pipeline stream's whole PCM and its End event (stream/handle.py), within `timeout` seconds."""
    import asyncio

    from higgs_stream.stream.handle import End

    pcm = []
    async with asyncio.timeout(timeout):
        while True:
            for ev in await handle.next(1 << 20):
                if isinstance(ev, End):
                    return b"".join(pcm), ev
                pcm.append(ev.pcm)


def default_voice():
    """The server's default voice (no reference audio)."""
    from higgs_stream.stream.voices import VoiceLibrary

    return VoiceLibrary().resolve("default")
