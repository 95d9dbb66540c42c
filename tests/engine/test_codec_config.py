"""CodecConfig: both config.json layouts, presets, derived values, and the transformers-default trap."""

import pytest
import torch
from higgs_stream.engine.codec import Codec, CodecConfig
from higgs_stream.engine.codec.config import HUBERT_BASE
from higgs_stream.engine.errors import ConfigError

# Boson's original codec config.json, verbatim (research/higgs_v2_reference.md §2.1).
ORIGINAL_CONFIG = {"n_filters": 32, "D": 256, "codebook_dim": 64, "target_bandwidths": [0.5, 1, 1.5, 2, 4],
                   "ratios": [8, 5, 4, 2, 3], "sample_rate": 24000, "bins": 1024, "n_q": 8,
                   "semantic_techer": "hubert_base_general"}

# The transformers-native hub config (the fields the converted repo carries).
HF_CONFIG = {
    "architectures": ["HiggsAudioV2TokenizerModel"], "model_type": "higgs_audio_v2_tokenizer",
    "sample_rate": 24000, "downsample_factor": 320, "codebook_dim": 64, "codebook_size": 1024,
    "kernel_size": 3, "block_dilations": [1, 1], "channel_ratios": [1, 1], "strides": [1, 1],
    "unit_kernel_size": 3, "initializer_range": 0.02, "semantic_sample_rate": 16000,
    "target_bandwidths": [0.5, 1, 1.5, 2],
    "acoustic_model_config": {"model_type": "dac", "encoder_hidden_size": 64, "decoder_hidden_size": 1024,
                              "hidden_size": 256, "downsampling_ratios": [8, 5, 4, 2, 3],
                              "upsampling_ratios": [8, 5, 4, 2, 3], "n_codebooks": 9, "codebook_dim": 8},
    "semantic_model_config": {"model_type": "hubert", "hidden_size": 768, "intermediate_size": 3072,
                              "num_hidden_layers": 12, "num_attention_heads": 12, "conv_dim": [512] * 7,
                              "conv_kernel": [10, 3, 3, 3, 3, 2, 2], "conv_stride": [5, 2, 2, 2, 2, 2, 2],
                              "num_conv_pos_embeddings": 128, "num_conv_pos_embedding_groups": 16,
                              "layer_norm_eps": 1e-5, "hidden_dropout": 0.1},
}


def test_full_preset_is_the_real_codec():
    cfg = CodecConfig.full()
    assert (cfg.hop, cfg.frame_rate, cfg.sample_rate) == (960, 25, 24000)
    assert (cfg.num_quantizers, cfg.codebook_size, cfg.codebook_dim) == (8, 1024, 64)
    assert (cfg.acoustic_dim, cfg.semantic_dim, cfg.hidden_size) == (256, 768, 1024)
    assert cfg.semantic_downsample_factor == 2
    assert cfg.receptive_field == 10


def test_both_layouts_parse_to_the_full_preset():
    assert CodecConfig.from_original_dict(ORIGINAL_CONFIG) == CodecConfig.full()
    assert CodecConfig.from_hf_dict(HF_CONFIG) == CodecConfig.full()


def test_transformers_default_config_is_not_the_higgs_codec():
    from transformers import HiggsAudioV2TokenizerConfig

    hf = HiggsAudioV2TokenizerConfig()
    # what transformers builds from its defaults: hop 320 (75 fps), 4 kbps / (75 * 10 bits) -> 5 quantizers
    assert (hf.hop_length, hf.num_quantizers) == (320, 5)
    with pytest.raises(ConfigError, match="not a Higgs codec"):
        CodecConfig.from_hf_dict(hf.to_dict())


@pytest.mark.parametrize("preset", ["tiny", "full"])
def test_hf_dict_round_trips_through_transformers(preset):
    from transformers import HiggsAudioV2TokenizerConfig

    cfg = CodecConfig.tiny() if preset == "tiny" else CodecConfig.full()
    kwargs = cfg.to_hf_dict()
    kwargs.pop("model_type")
    hf = HiggsAudioV2TokenizerConfig(**kwargs)
    assert (hf.hop_length, hf.num_quantizers, hf.hidden_size) == (cfg.hop, cfg.num_quantizers, cfg.hidden_size)
    assert hf.semantic_downsample_factor == cfg.semantic_downsample_factor
    assert list(hf.acoustic_model_config.upsampling_ratios) == list(cfg.decoder_ratios)
    assert CodecConfig.from_hf_dict(hf.to_dict()) == cfg
    assert CodecConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_original_dict_round_trip_and_extension_keys():
    assert CodecConfig.full().to_original_dict() == ORIGINAL_CONFIG  # the real file has no extension keys
    tiny = CodecConfig.tiny()
    d = tiny.to_original_dict()
    assert d["encoder_hidden_size"] == 4 and d["decoder_hidden_size"] == 64
    assert d["semantic_model_config"]["hidden_size"] == 32
    assert CodecConfig.from_original_dict(d) == tiny


def test_tiny_keeps_the_real_kernel_structure():
    tiny, full = CodecConfig.tiny(), CodecConfig.full()
    assert tiny.decoder_ratios == full.decoder_ratios and tiny.hop == 960
    assert tiny.receptive_field == full.receptive_field == 10
    assert (tiny.num_quantizers, tiny.codebook_size) == (8, 1024)


def test_full_structure_matches_transformers_key_for_key():
    """Our modules (built on meta) carry exactly the reference's tensor names and shapes (minus training-only)."""
    from transformers import HiggsAudioV2TokenizerConfig, HiggsAudioV2TokenizerModel

    cfg = CodecConfig.full()
    kwargs = cfg.to_hf_dict()
    kwargs.pop("model_type")
    with torch.device("meta"):
        ref = HiggsAudioV2TokenizerModel(HiggsAudioV2TokenizerConfig(**kwargs))
        ours = Codec(cfg, with_encoder=True)
    ref_sd = {k.replace(".parametrizations.weight.original1", ".weight"): v for k, v in ref.state_dict().items()
              if not k.startswith(("decoder_semantic.", "fc1.")) and ".original0" not in k
              and not k.endswith(("embed_avg", "cluster_size", "inited"))}
    ours_sd = ours.state_dict()
    assert sorted(ref_sd) == sorted(ours_sd)
    assert all(tuple(ref_sd[k].shape) == tuple(ours_sd[k].shape) for k in ours_sd)
    n_decode = sum(v.numel() for k, v in ours_sd.items() if k.startswith(("acoustic_decoder", "fc2")))
    assert 20.0e6 < n_decode < 21.0e6  # decoder_2 20.2M + fc2 0.26M (research §2.2)


@pytest.mark.parametrize("bad", [
    {"decoder_ratios": (8, 5, 4, 2)},  # hop differs from the encoder's
    {"num_quantizers": 0},
    {"decoder_hidden_size": 100},  # not divisible by 2**5
    {"semantic_model": {"num_hidden_layers": 2}},  # no hidden_size
])
def test_invalid_configs_raise(bad):
    with pytest.raises(ConfigError):
        CodecConfig.full(**bad)


def test_original_dict_rejects_what_we_cannot_run():
    with pytest.raises(ConfigError, match="missing"):
        CodecConfig.from_original_dict({"D": 256})
    with pytest.raises(ConfigError, match="semantic_techer"):
        CodecConfig.from_original_dict({**ORIGINAL_CONFIG, "semantic_techer": "w2v_bert2"})
    with pytest.raises(ConfigError, match="FSQ"):
        CodecConfig.from_original_dict({**ORIGINAL_CONFIG, "bins": [8, 5, 5]})
    with pytest.raises(ConfigError, match="model_type"):
        CodecConfig.from_hf_dict({**HF_CONFIG, "model_type": "dac"})


def test_hubert_dict_keeps_only_inference_fields():
    cfg = CodecConfig.from_hf_dict(HF_CONFIG)
    assert set(cfg.semantic_model) == set(HUBERT_BASE)
