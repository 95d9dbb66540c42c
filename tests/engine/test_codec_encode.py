"""Reference-audio encode: parity with transformers, the original's pad/trim rule, input handling, cache."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from higgs_stream.engine.codec import codec as codec_module
from higgs_stream.engine.codec import load_codec, write_random_codec
from higgs_stream.engine.codec.audio_io import to_codec_rate
from higgs_stream.engine.codec.encoder import acoustic_frames
from higgs_stream.engine.errors import AudioInputError, CheckpointError

HOP = 960


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec")
    return {layout: write_random_codec(root / layout, "tiny", layout, seed=5) for layout in ("hf", "original")}


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    from transformers import HiggsAudioV2TokenizerModel

    return HiggsAudioV2TokenizerModel.from_pretrained(tiny_dirs["hf"]).eval()


@pytest.fixture(scope="module")
def codec(tiny_dirs):
    return load_codec(tiny_dirs["hf"])


def noise(num_samples: int, seed: int) -> torch.Tensor:
    return torch.randn(1, 1, num_samples, generator=torch.Generator().manual_seed(seed)) * 0.3


@torch.no_grad()
def reference_latent(ref, wav: torch.Tensor, pad: int | None) -> torch.Tensor:
    """transformers' submodules with an explicit acoustic pad (None = no re-run): the fc output [B, H, F]."""
    sem = ref.encoder_semantic(ref._extract_semantic_features(wav).transpose(1, 2))
    ac = ref.acoustic_encoder(wav if pad is None else F.pad(wav, (pad, pad)))
    n = min(ac.shape[2], sem.shape[2])
    return ref.fc(torch.cat([ac[:, :, :n], sem[:, :, :n]], 1).transpose(1, 2)).transpose(1, 2)


@torch.no_grad()
def our_latent(codec, wav: torch.Tensor) -> torch.Tensor:
    from higgs_stream.engine.codec.encoder import align_acoustic, semantic_features

    sem = codec.encoder_semantic(semantic_features(codec.semantic_model, wav, codec.cfg).transpose(1, 2))
    ac, sem = align_acoustic(codec.acoustic_encoder, wav, sem, codec.cfg)
    return codec.fc(torch.cat([ac, sem], 1).transpose(1, 2)).transpose(1, 2)


def test_encode_matches_transformers_when_branch_lengths_agree(tiny_dirs, reference):
    codecs = {layout: load_codec(path) for layout, path in tiny_dirs.items()}
    for length, seed in ((4 * HOP, 0), (10 * HOP, 1)):  # whole frames: both branches give F frames
        wav = noise(length, seed)
        with torch.no_grad():
            ref_codes = reference.encode(wav, return_dict=False)  # [1, 8, F]
        assert ref_codes.shape == (1, 8, length // HOP)
        for layout, c in codecs.items():
            assert torch.equal(c.encode_tensor(wav), ref_codes), layout
        lat, ref_lat = our_latent(codecs["hf"], wav), reference_latent(reference, wav, None)
        assert float((lat - ref_lat).abs().max() / ref_lat.abs().max()) <= 1e-5
        # the codes are not degenerate: several distinct entries per codebook
        assert all(len(set(row.tolist())) > 1 for row in ref_codes[0])


def test_length_mismatch_follows_the_original_not_transformers(codec, reference):
    """3200 samples: acoustic 3 frames vs semantic 4. The original re-runs the acoustic encoder padded 320
    per side (160 * semantic factor 2); transformers pads hop/2 = 480. Same frame count, different codes."""
    wav = noise(3200, 2)
    assert acoustic_frames(codec.cfg, 3200) == 3
    ours = codec.encode_tensor(wav)
    assert ours.shape == (1, 8, 4)
    original_rule = codec.quantizer.encode(reference_latent(reference, wav, 320))
    transformers_rule = codec.quantizer.encode(reference_latent(reference, wav, 480))
    assert torch.equal(ours, original_rule)
    assert not torch.equal(ours, transformers_rule)
    with torch.no_grad():
        assert torch.equal(reference.encode(wav, return_dict=False), transformers_rule)  # what it really does


def test_encode_numpy_any_rate_any_channels(codec):
    rng = np.random.default_rng(0)
    mono24 = (rng.standard_normal(10 * HOP) * 0.3).astype(np.float32)
    codes = codec.encode(mono24, 24000)
    assert codes.dtype == np.int64 and codes.shape == (8, 10)
    assert np.array_equal(codes, codec.encode_tensor(torch.from_numpy(mono24)[None, None])[0].numpy())

    stereo48 = (rng.standard_normal((2, 20 * HOP)) * 0.3).astype(np.float32)
    expected_wav = to_codec_rate(stereo48, 48000)  # channel mean, then torchaudio resample to 24 kHz
    assert expected_wav.shape == (10 * HOP,)
    got = codec.encode(stereo48, 48000)
    want = codec.encode_tensor(torch.from_numpy(expected_wav)[None, None])[0].numpy()
    assert np.array_equal(got, want)


def test_encode_rejects_bad_audio(codec):
    with pytest.raises(AudioInputError, match="silent"):
        codec.encode(np.zeros(24000, np.float32), 24000)
    with pytest.raises(AudioInputError, match="too long"):
        codec.encode(np.ones(24000 * 3, np.float32) * 0.1, 24000, max_seconds=2.0)
    with pytest.raises(AudioInputError, match="empty"):
        codec.encode(np.zeros(0, np.float32), 24000)


def test_encode_cache_hits_by_content_and_evicts_lru(codec, monkeypatch):
    codec._cache.clear()
    calls = []
    real = codec.encode_tensor
    monkeypatch.setattr(codec, "encode_tensor", lambda x: calls.append(x.shape[-1]) or real(x))
    monkeypatch.setattr(codec_module, "ENCODE_CACHE_SIZE", 2)
    rng = np.random.default_rng(1)
    a, b, c = ((rng.standard_normal(4 * HOP) * 0.3).astype(np.float32) for _ in range(3))
    first = codec.encode(a, 24000)
    first[:] = -1  # callers get copies; the cache is not corrupted
    again = codec.encode(a.copy(), 24000)  # equal content, different array object
    assert len(calls) == 1 and (again >= 0).all()
    codec.encode(a, 16000)  # same samples at another rate is another key
    assert len(calls) == 2
    codec.encode(b, 24000)
    codec.encode(c, 24000)  # evicts (a, 24000) and (a, 16000)
    codec.encode(a, 24000)
    assert len(calls) == 5
    assert len(codec._cache) == 2


def test_decode_only_codec_cannot_encode(tiny_dirs):
    c = load_codec(tiny_dirs["original"], with_encoder=False)
    assert not c.can_encode and not hasattr(c, "semantic_model")
    with pytest.raises(CheckpointError, match="without encoder weights"):
        c.encode(np.ones(24000, np.float32) * 0.1, 24000)
