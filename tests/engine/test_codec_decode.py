"""Code2Wav decode: parity with transformers, receptive field (measured and analytic), exact windowed decode."""

import pytest
import torch
from higgs_stream.engine.codec import Codec, CodecConfig, load_codec, write_random_codec
from higgs_stream.engine.codec.decoder import AcousticDecoder, influence_interval
from higgs_stream.engine.errors import InvalidInputError

HOP = 960


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec")
    return {layout: write_random_codec(root / layout, "tiny", layout, seed=3) for layout in ("hf", "original")}


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    from transformers import HiggsAudioV2TokenizerModel

    return HiggsAudioV2TokenizerModel.from_pretrained(tiny_dirs["hf"]).eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_decode_matches_transformers_in_both_layouts(tiny_dirs, reference):
    codes = torch.randint(0, 1024, (3, 8, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = reference.decode(codes, return_dict=False)[:, 0]  # [3, 17*960]
    assert ref.abs().max() > 1e-2  # random weights keep the signal well above rounding
    outs = {}
    for layout, path in tiny_dirs.items():
        codec = load_codec(path)
        out = codec.decode(codes)
        assert out.shape == (3, 17 * HOP) and out.dtype == torch.float32
        assert rel_err(out, ref) <= 1e-5, layout
        outs[layout] = out
    assert torch.equal(outs["hf"], outs["original"])


def test_decode_is_batched_row_independent(tiny_dirs):
    codec = load_codec(tiny_dirs["hf"], with_encoder=False)
    codes = torch.randint(0, 1024, (3, 8, 6), generator=torch.Generator().manual_seed(1))
    batched = codec.decode(codes)
    singles = torch.cat([codec.decode(codes[i:i + 1]) for i in range(3)])
    assert rel_err(batched, singles) <= 1e-5  # conv blocking differs with batch size: rounding only
    np_out = codec.decode(codes.numpy())  # numpy input is accepted too
    assert torch.equal(np_out, batched)


def test_decode_rejects_bad_codes(tiny_dirs):
    codec = load_codec(tiny_dirs["hf"], with_encoder=False)
    good = torch.zeros(1, 8, 4, dtype=torch.long)
    for bad, match in [(good[:, :7], r"\[B, 8, F\]"), (good[0], r"\[B, 8, F\]"), (good.float(), "integers"),
                       (good + 1024, "0..1023"), (good - 1, "0..1023")]:
        with pytest.raises(InvalidInputError, match=match):
            codec.decode(bad)
    assert codec.decode(torch.zeros(2, 8, 0, dtype=torch.long)).shape == (2, 0)


def test_receptive_field_full_size_decoder():
    """Real architecture (1024 channels), fp32: changing the codes of frame 11 changes exactly frames 1..21."""
    cfg = CodecConfig.full()
    torch.manual_seed(0)
    codec = Codec(cfg, with_encoder=False)  # random init; the codebooks get random rows
    with torch.no_grad():
        for q in codec.quantizer.quantizers:
            q.codebook.embed.normal_()
    f, frames = 11, 23
    codes = torch.randint(0, 1024, (1, 8, frames)).repeat(2, 1, 1)
    codes[1, :, f] = (codes[1, :, f] + 1) % 1024
    out = codec.decode(codes)  # [2, 25*960]
    changed = (out[0] - out[1]).abs().view(frames, HOP).amax(dim=1) > 0
    changed_frames = changed.nonzero()[:, 0].tolist()
    assert changed_frames == list(range(f - 10, f + 11))
    assert codec.receptive_field == 10


def test_receptive_field_exact_sample_extent():
    """fp64 forward-mode derivative w.r.t. one latent frame: non-zero on exactly the analytic interval."""
    cfg = CodecConfig.tiny()
    torch.manual_seed(0)
    dec = AcousticDecoder(cfg).double()
    with torch.no_grad():
        for m in dec.modules():
            if hasattr(m, "alpha"):
                m.alpha.uniform_(0.5, 1.5)
    f, frames = 11, 23
    latent = torch.randn(1, cfg.acoustic_dim, frames, dtype=torch.double)
    tangent = torch.zeros_like(latent)
    tangent[:, :, f] = torch.randn(cfg.acoustic_dim, dtype=torch.double)
    _, jvp = torch.func.jvp(dec, (latent,), (tangent,))
    nz = jvp[0, 0].nonzero()[:, 0]
    lo, hi = influence_interval(cfg, f)
    assert (int(nz.min()), int(nz.max())) == (lo, hi) == (f * HOP - 9458, f * HOP + 10392)
    assert len(nz) == hi - lo + 1  # no holes
    # in frames: the cone starts 9.85 frames before frame f's first sample and ends 10.8 frames after it
    assert (lo // HOP, hi // HOP) == (f - 10, f + 10)


def test_windowed_decode_is_exact_with_ten_frames_each_side(tiny_dirs):
    """Decoding frames [a-10, b+10] and keeping [a, b] equals the one-shot decode; 9 frames do not suffice."""
    codec = load_codec(tiny_dirs["hf"], with_encoder=False)
    codes = torch.randint(0, 1024, (1, 8, 36), generator=torch.Generator().manual_seed(2))
    full = codec.decode(codes)[0]
    a, b = 12, 23  # emit frames [a, b]
    errs = {}
    for context in (10, 9):
        window = codec.decode(codes[:, :, a - context:b + 1 + context])[0]
        part = window[context * HOP:(context + b - a + 1) * HOP]
        errs[context] = rel_err(part, full[a * HOP:(b + 1) * HOP])
    assert errs[10] <= 1e-5
    assert errs[9] > 1e-4  # one frame short of the receptive field: well above fp32 rounding
