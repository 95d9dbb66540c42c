"""Codec loaders: both layouts, the key table, weight-norm folding, bundled (v3) state dicts, typed errors."""

import json
import shutil

import pytest
import torch
from higgs_stream.engine.codec import (
    CodecConfig,
    codec_from_state_dict,
    load_codec,
    original_names,
    write_random_codec,
)
from higgs_stream.engine.codec.layers import fold_weight_norm, unfold_weight_norm
from higgs_stream.engine.codec.load import is_encoder_key
from higgs_stream.engine.errors import CheckpointError
from higgs_stream.engine.models.higgs_v3.checkpoint import CODEC_PREFIX as V3_CODEC_PREFIX
from safetensors.torch import load_file, save_file

TINY = CodecConfig.tiny()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("codec")
    return {layout: write_random_codec(root / layout, "tiny", layout, seed=7) for layout in ("hf", "original")}


@pytest.fixture(scope="module")
def hf_state(dirs):
    return load_file(dirs["hf"] / "model.safetensors")


@pytest.fixture(scope="module")
def orig_state(dirs):
    return torch.load(dirs["original"] / "model.pth", weights_only=True)


@pytest.fixture(scope="module")
def codes():
    return torch.randint(0, 1024, (2, 8, 5), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def expected_wav(dirs, codes):
    return load_codec(dirs["hf"], with_encoder=False).decode(codes)


def test_written_files_are_the_real_layouts(dirs, hf_state, orig_state):
    assert sorted(p.name for p in dirs["hf"].iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((dirs["hf"] / "config.json").read_text())["model_type"] == "higgs_audio_v2_tokenizer"
    assert sorted(p.name for p in dirs["original"].iterdir()) == ["config.json", "model.pth"]
    assert json.loads((dirs["original"] / "config.json").read_text())["n_q"] == 8
    # original names (research §2.4), weight-normed DAC convs; ConvTranspose g is per INPUT channel
    for key in ("encoder.block.0.weight_g", "encoder.block.1.block.0.block.1.weight_v", "encoder.block.1.block.3.alpha",
                "encoder.block.7.weight_g", "decoder_2.model.0.weight_g", "decoder_2.model.1.block.0.alpha",
                "decoder_2.model.5.block.4.block.3.weight_g", "decoder_2.model.7.bias",
                "quantizer.vq.layers.7._codebook.embed", "quantizer.vq.layers.0.project_in.weight",
                "fc_prior.weight", "fc_post1.weight", "fc_post2.bias", "encoder_semantic.conv.conv.weight",
                "encoder_semantic.conv_blocks.1.res_units.0.conv1.conv.weight",
                "encoder_semantic.conv_blocks.1.res_units.0.conv2.weight", "encoder_semantic.conv_blocks.0.conv.conv.bias",
                "decoder_semantic.conv2.conv.weight", "semantic_model.encoder.pos_conv_embed.conv.weight_g",
                "semantic_model.masked_spec_embed"):
        assert key in orig_state, key
    w = orig_state["decoder_2.model.1.block.1.weight_v"]  # ConvTranspose1d [in=64, out=32, k=16]
    assert tuple(w.shape) == (64, 32, 16)
    assert tuple(orig_state["decoder_2.model.1.block.1.weight_g"].shape) == (64, 1, 1)
    assert not any(k.endswith(".weight") and k.startswith(("encoder.", "decoder_2.")) for k in orig_state)
    assert "acoustic_decoder.block.0.conv_t1.weight" in hf_state


def test_table_covers_every_module_of_both_files(hf_state, orig_state):
    table = original_names(TINY)
    hf_modules = {k.rpartition(".")[0] for k in hf_state if not k.startswith("semantic_model.")}
    assert hf_modules == set(table)
    orig_modules = {k.rpartition(".")[0] for k in orig_state if not k.startswith("semantic_model.")}
    assert orig_modules == set(table.values())
    assert len(set(table.values())) == len(table)  # one-to-one


def test_fold_weight_norm_conventions():
    torch.manual_seed(0)
    w = torch.randn(6, 3, 4)  # e.g. ConvTranspose1d [in, out, k]: dim 0 = input channel
    g, v = unfold_weight_norm(w)
    v = v * torch.rand(6, 1, 1) * 5  # a real v has any norm; only its direction matters
    assert tuple(g.shape) == (6, 1, 1)
    torch.testing.assert_close(fold_weight_norm(g, v), w, rtol=1e-6, atol=1e-6)
    g2 = torch.linalg.vector_norm(w, dim=(0, 1), keepdim=True)  # HuBERT pos-conv: dim 2, g [1, 1, K]
    torch.testing.assert_close(fold_weight_norm(g2, w * 3), w, rtol=1e-6, atol=1e-6)
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.ConvTranspose1d(6, 3, 4))
    p = conv.parametrizations.weight
    torch.testing.assert_close(fold_weight_norm(p.original0, p.original1), conv.weight, rtol=1e-6, atol=1e-7)


def test_layouts_load_identical_codecs(dirs, codes, expected_wav):
    a, b = load_codec(dirs["hf"]), load_codec(dirs["original"])
    assert a.can_encode and b.can_encode
    assert torch.equal(b.decode(codes), expected_wav)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert max(float((sa[k] - sb[k]).abs().max()) for k in sa) <= 1e-6  # fold of an unfolded weight


def test_decode_only_checkpoint_needs_no_encoder_weights(tmp_path, dirs, hf_state, codes, expected_wav):
    dec_only = {k: v for k, v in hf_state.items() if not is_encoder_key(k)}
    assert len(dec_only) < len(hf_state) and not any(k.startswith("semantic_model.") for k in dec_only)
    d = tmp_path / "dec"
    d.mkdir()
    shutil.copy(dirs["hf"] / "config.json", d / "config.json")
    save_file(dec_only, d / "model.safetensors")
    codec = load_codec(d)
    assert not codec.can_encode
    assert torch.equal(codec.decode(codes), expected_wav)
    with pytest.raises(CheckpointError, match="missing key quantizer.quantizers.0.project_in.weight"):
        load_codec(d, with_encoder=True)


def test_v3_bundled_prefix_state_dict(hf_state, codes, expected_wav):
    """The v3 checkpoint bundles the codec under a prefix, beside talker keys, with `codebook.weight`."""
    bundled = {"body.layers.0.mlp.up_proj.weight": torch.zeros(2, 2), "tied.embedding.text_embedding.weight": torch.zeros(3)}
    for k, v in hf_state.items():
        k = k.replace("codebook.embed", "codebook.weight") if k.endswith("codebook.embed") else k
        bundled[V3_CODEC_PREFIX + k] = v
    codec = codec_from_state_dict(bundled, TINY, prefix=V3_CODEC_PREFIX, with_encoder=False)
    assert torch.equal(codec.decode(codes), expected_wav)
    with pytest.raises(CheckpointError, match="no tensors under prefix"):
        codec_from_state_dict(bundled, TINY, prefix="nothing.here.")


def test_parametrized_weight_norm_in_hf_layout(hf_state, codes, expected_wav):
    sd = {}
    for k, v in hf_state.items():
        if k.startswith("acoustic_decoder.") and k.endswith(".weight") and v.dim() == 3:
            g, vv = unfold_weight_norm(v)
            sd[k.replace(".weight", ".parametrizations.weight.original0")] = g
            sd[k.replace(".weight", ".parametrizations.weight.original1")] = vv * 2.0
        else:
            sd[k] = v
    out = codec_from_state_dict(sd, TINY, with_encoder=False).decode(codes)
    assert float((out - expected_wav).abs().max() / expected_wav.abs().max()) <= 1e-5


@pytest.mark.parametrize("layout,edit,match", [
    ("original", lambda s: s.pop("decoder_2.model.3.block.1.weight_v"),
     "decoder_2.model.3.block.1.weight_v is missing"),
    ("original", lambda s: [s.pop("decoder_2.model.3.block.1.weight_v"), s.pop("decoder_2.model.3.block.1.weight_g")],
     "missing key decoder_2.model.3.block.1.weight"),
    ("original", lambda s: s.pop("quantizer.vq.layers.5._codebook.embed"),
     "missing key quantizer.vq.layers.5._codebook.embed"),
    ("original", lambda s: s.__setitem__("decoder_2.model.9.alpha", s["decoder_2.model.6.alpha"]),
     "unexpected key decoder_2.model.9.alpha"),
    ("original", lambda s: s.__setitem__("fc_post2.bias", torch.zeros(7)),
     r"fc_post2.bias has shape \(7,\), expected \(16,\)"),
    ("original", lambda s: s.pop("semantic_model.encoder.layers.1.attention.q_proj.weight"),
     r"missing key semantic_model.encoder.layers.1.attention.q_proj.weight \(the encoder part is incomplete\)"),
    ("hf", lambda s: s.pop("acoustic_decoder.block.2.res_unit3.snake2.alpha"),
     "missing key acoustic_decoder.block.2.res_unit3.snake2.alpha"),
    ("hf", lambda s: s.__setitem__("quantizer.quantizers.8.project_out.bias", torch.zeros(48)),
     "unexpected key quantizer.quantizers.8.project_out.bias"),
    ("hf", lambda s: s.__setitem__("fc2.weight", torch.zeros(16, 47)),
     r"fc2.weight has shape \(16, 47\), expected \(16, 48\)"),
])
def test_bad_checkpoints_name_the_key(hf_state, orig_state, layout, edit, match):
    sd = dict(orig_state if layout == "original" else hf_state)
    edit(sd)
    with pytest.raises(CheckpointError, match=match):
        codec_from_state_dict(sd, TINY, layout=layout)


def test_load_codec_file_errors(tmp_path, dirs):
    with pytest.raises(CheckpointError, match="not a hub repo id"):
        load_codec(tmp_path / "missing" / "dir")
    d = tmp_path / "weird"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="neither"):
        load_codec(d)
    shutil.copy(dirs["original"] / "config.json", d / "config.json")
    with pytest.raises(CheckpointError, match="model.pth is missing"):
        load_codec(d)
    (d / "model.pth").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_codec(d)
    shutil.copy(dirs["hf"] / "config.json", d / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_codec(d)


def test_hub_ids_go_through_snapshot_download(monkeypatch, dirs, codes, expected_wav):
    import huggingface_hub

    seen = {}

    def fake_snapshot_download(repo_id, allow_patterns=None):
        seen["repo_id"] = repo_id
        return str(dirs["hf"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    codec = load_codec("bosonai/higgs-audio-v2-tokenizer", with_encoder=False)
    assert seen["repo_id"] == "bosonai/higgs-audio-v2-tokenizer"
    assert torch.equal(codec.decode(codes), expected_wav)

    def offline(repo_id, allow_patterns=None):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError, match="download from the hub failed.*no network"):
        load_codec("someone/some-codec")


def _broken_copy(tmp_path, dirs, config=None, weights=None):
    d = shutil.copytree(dirs["hf"], tmp_path / "c")
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if weights is not None:
        weights(d / "model.safetensors")
    return d


@pytest.mark.parametrize("config,weights,match", [
    (None, lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]),
     r"model.safetensors: cannot read as safetensors: .*incomplete metadata"),
    (lambda c: c.update(sample_rate=-1), None, r"config.json: codec config: sample_rate must be an int in \[1, "),
    (lambda c: c.update(sample_rate=0), None, r"codec config: sample_rate must be an int in \[1, "),
    (lambda c: c.update(sample_rate="24000"), None, "codec config: sample_rate must be an int, got '24000'"),
    (lambda c: c.update(acoustic_model_config="x"), None, "acoustic_model_config must be a JSON object, got 'x'"),
    (lambda c: c.update(target_bandwidths="x"), None, "target_bandwidths must be a non-empty list of positive numbers"),
    (lambda c: c["acoustic_model_config"].update(hidden_size=16.5), None,
     "acoustic_model_config.hidden_size must be an int, got 16.5"),
    (lambda c: c.update(semantic_model_config="x"), None, "semantic_model_config must be a JSON object"),
    (lambda c: c["semantic_model_config"].update(num_hidden_layers=10**9), None,  # checked before building HuBERT
     "semantic_model_config.num_hidden_layers is 1000000000, but the weight files hold 2 layers"),
    (lambda c: c.update(target_bandwidths=[1e9]), None,  # ~4e6 quantizers: checked before building them
     r"the config's quantizer count is \d+, but the weight files hold 8 quantizers"),
])
def test_bad_codec_files_raise_checkpoint_error(tmp_path, dirs, config, weights, match):
    d = _broken_copy(tmp_path, dirs, config, weights)
    with pytest.raises(CheckpointError, match=match) as e:
        load_codec(d)
    assert e.value.code == "checkpoint"


def test_unreadable_codec_files_say_permission_denied(tmp_path, dirs, monkeypatch):
    """(As root chmod 000 does not deny a read, so the OS error is injected.)"""
    import safetensors.torch

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(safetensors.torch, "load_file", denied)
    with pytest.raises(CheckpointError, match=r"model.safetensors: cannot read: permission denied"):
        load_codec(dirs["hf"])
    monkeypatch.setattr(type(dirs["hf"]), "read_bytes", denied)
    with pytest.raises(CheckpointError, match=r"config.json: permission denied"):
        load_codec(dirs["hf"])
