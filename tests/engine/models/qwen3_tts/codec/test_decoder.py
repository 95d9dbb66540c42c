"""The 12 Hz tokenizer's decoder against the official reference (PyPI qwen-tts 0.1.1, fixtures made by
scripts/qwen3_reference_fixtures.py), its geometry, and loading errors."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from higgs_stream.engine.errors import CheckpointError, InvalidInputError
from higgs_stream.engine.models.qwen3_tts.codec import FULL, QwenCodec, load_qwen_codec
from higgs_stream.testing import check_tensors_are_named

BOUND = 1e-5  # max |ours - reference| / max |reference|, fp32 (measured 3.3e-6 on this tiny decoder)


@pytest.fixture(scope="module")
def codec(tiny_dir) -> QwenCodec:
    return load_qwen_codec(tiny_dir)


def test_one_shot_decode_matches_the_reference(codec, ref):
    codes = torch.from_numpy(ref["decode_codes"].astype(np.int64))  # [1, 16, 9]
    got = codec.decode(codes).numpy()
    want = ref["decode_wav"]
    assert got.shape == want.shape == (1, 9 * 1920)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= BOUND, f"decode differs from the reference by {err:.3g} of peak"


def test_geometry_tiny_and_full(codec):
    g = codec.geometry
    assert (g.num_codebooks, g.codebook_size, g.hop, g.sample_rate) == (16, 64, 1920, 24000)
    assert g.causal and g.lookahead_samples == 0 and g.lookahead_frames == 0
    # window 4 over 2 layers (3 each), pre_conv 2, the sample-domain histories 10 frames
    assert g.receptive_field == 2 * 3 + 2 + 10
    with torch.device("meta"):
        full = QwenCodec(FULL)
    g = full.geometry
    assert (g.num_codebooks, g.codebook_size, g.hop, g.sample_rate, g.causal) == (16, 2048, 1920, 24000, True)
    assert g.receptive_field == 8 * 71 + 2 + 10
    assert g.frame_seconds == pytest.approx(0.08)


def test_decode_checks_its_input(codec):
    with pytest.raises(InvalidInputError, match="codes must be"):
        codec.decode(torch.zeros(1, 15, 3, dtype=torch.long))
    with pytest.raises(InvalidInputError, match="0..63"):
        codec.decode(torch.full((1, 16, 2), 64))
    assert codec.decode(torch.zeros(2, 16, 0, dtype=torch.long)).shape == (2, 0)


def _copy(tmp_path: Path, tiny_dir: Path) -> Path:
    root = tmp_path / "speech_tokenizer"
    shutil.copytree(tiny_dir / "speech_tokenizer", root)
    return root


def test_a_missing_unexpected_or_misshaped_tensor_is_named(tmp_path, tiny_dir):
    root = _copy(tmp_path, tiny_dir)
    check_tensors_are_named(root / "model.safetensors", lambda: load_qwen_codec(root),
                            "decoder.pre_transformer.layers.1.mlp.up_proj.weight", "decoder.extra.weight",
                            "decoder.pre_conv.conv.bias", (5,))


def test_a_foreign_config_is_refused(tmp_path, tiny_dir):
    root = _copy(tmp_path, tiny_dir)
    raw = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**raw, "model_type": "mimi"}))
    with pytest.raises(CheckpointError, match="model_type 'mimi'"):
        load_qwen_codec(root)
    (root / "config.json").write_text(json.dumps({**raw, "decode_upsample_rate": 960}))
    with pytest.raises(CheckpointError, match="decode_upsample_rate 960"):
        load_qwen_codec(root)


def test_codebook_tables_follow_the_weights_and_inference_tensors():
    """The stacked codebook table is cached, remade when a codebook tensor changes in place (a load), and
    not cached for a codec made under torch.inference_mode (its tensors keep no version)."""
    import torch
    from higgs_stream.engine.models.qwen3_tts.codec.config import QwenCodecConfig
    from higgs_stream.engine.models.qwen3_tts.codec.decoder import SplitRVQ

    cfg = QwenCodecConfig(codebook_size=8, codebook_dim=4, num_quantizers=3)
    q = SplitRVQ(cfg)
    g = torch.Generator().manual_seed(0)
    for p in q.parameters():
        p.data.copy_(torch.rand(p.shape, generator=g) + 0.5)
    codes = torch.randint(0, 8, (2, 3, 5), generator=g)

    def plain(q):  # the sum of each codebook's lookup, projected, by hand
        out = 0
        for group, cols in ((q.rvq_first, codes[:, :1]), (q.rvq_rest, codes[:, 1:])):
            acc = sum(torch.nn.functional.embedding(cols[:, i], l._codebook.table()) for i, l in enumerate(group.vq.layers))
            out = out + torch.nn.functional.conv1d(acc.transpose(1, 2), group.output_proj.weight)
        return out

    assert torch.allclose(q(codes), plain(q), atol=1e-6)
    with torch.no_grad():
        q.rvq_rest.vq.layers[1]._codebook.embedding_sum.mul_(3.0)  # loaded in place
    assert torch.allclose(q(codes), plain(q), atol=1e-6)
    with torch.inference_mode():
        qi = SplitRVQ(cfg)
        qi.load_state_dict(q.state_dict())
        assert torch.allclose(qi(codes), plain(q), atol=1e-6)
