import dataclasses
import json

import pytest
from transformers import HiggsAudioV2Config

from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.models.higgs_v2.config import SPECIAL_TOKEN_STRINGS, SpecialTokens, TalkerConfig

# Boson's original config.json (model_type "higgs_audio"), fields from research/higgs_v2_reference.md §1.1-1.2
ORIGINAL = {
    "model_type": "higgs_audio",
    "architectures": ["HiggsAudioModel"],
    "audio_adapter_type": "dual_ffn_fast_forward",
    "audio_dual_ffn_layers": list(range(28)),
    "audio_ffn_hidden_size": 3072,
    "audio_ffn_intermediate_size": 8192,
    "audio_decoder_proj_num_layers": 0,
    "audio_embed_avg": False,
    "encode_whisper_embed": False,
    "encode_audio_in_tokens": True,
    "skip_audio_tower": True,
    "use_delay_pattern": True,
    "use_audio_out_embed_projector": False,
    "use_audio_out_self_attention": 0,
    "use_rq_transformer": False,
    "audio_num_codebooks": 8,
    "audio_codebook_size": 1024,
    "audio_stream_bos_id": 1024,
    "audio_stream_eos_id": 1025,
    "audio_in_token_idx": 128015,
    "audio_out_token_idx": 128016,
    "pad_token_id": 128001,
    "hidden_size": 3072,
    "text_config": {
        "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "vocab_size": 128256, "tie_word_embeddings": True,
    },
}


def test_hf_native_full_config_maps_1026_rows_to_1024_codes():
    hf = HiggsAudioV2Config(codebook_size=1026).to_dict()  # what the conversion script writes
    cfg = TalkerConfig.from_hf_dict(json.loads(json.dumps(hf)))
    assert (cfg.codebook_size, cfg.audio_vocab, cfg.num_codebooks) == (1024, 1026, 8)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3072, 28, 24, 8, 128)
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 0.125,
                                "high_freq_factor": 0.5, "original_max_position_embeddings": 1024}
    assert cfg.special is None  # filled from the tokenizer by the loader


def test_hf_class_default_codebook_size_is_rejected():
    # HiggsAudioV2Config() says codebook_size=1024, which leaves no rows for stream BOS/EOS 1024/1025
    with pytest.raises(ConfigError, match="embedding rows per codebook"):
        TalkerConfig.from_hf_dict(HiggsAudioV2Config().to_dict())


def test_original_config_gives_the_same_architecture():
    orig = TalkerConfig.from_original_dict(ORIGINAL)
    full = TalkerConfig.full(special=None)
    assert orig == full
    hf = TalkerConfig.from_hf_dict(HiggsAudioV2Config(codebook_size=1026).to_dict())
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "num_codebooks", "codebook_size")
    assert all(getattr(orig, f) == getattr(hf, f) for f in same)


def test_original_config_variants_we_cannot_run_are_rejected():
    partial = {**ORIGINAL, "audio_dual_ffn_layers": [0, 1, 2]}
    with pytest.raises(ConfigError, match="DualFFN"):
        TalkerConfig.from_original_dict(partial)
    with pytest.raises(ConfigError, match="use_audio_out_self_attention"):
        TalkerConfig.from_original_dict({**ORIGINAL, "use_audio_out_self_attention": True})
    no_text = {k: v for k, v in ORIGINAL.items() if k != "text_config"}
    with pytest.raises(ConfigError, match="text_config"):
        TalkerConfig.from_original_dict(no_text)
    with pytest.raises(ConfigError, match="model_type"):
        TalkerConfig.from_original_dict({**ORIGINAL, "model_type": "llama"})


def test_tiny_round_trips_through_transformers_config():
    tiny = TalkerConfig.tiny()
    # transformers' default audio_delay_token_id (128014) lies outside the tiny vocabulary: one inside, as test_talker
    hf = HiggsAudioV2Config(**tiny.to_hf_dict(), audio_delay_token_id=tiny.vocab_size - 1)
    assert hf.codebook_size == 1026 and hf.audio_token_id == tiny.special.audio_out
    assert TalkerConfig.from_hf_dict(hf.to_dict()) == dataclasses.replace(tiny, special=None)


def test_validation_errors():
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        TalkerConfig.tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="llama3"):
        TalkerConfig.tiny(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="lacks"):
        TalkerConfig.tiny(rope_scaling={"rope_type": "llama3", "factor": 4.0})
    with pytest.raises(ConfigError, match="outside vocab_size"):
        TalkerConfig.tiny(vocab_size=260)
    with pytest.raises(ConfigError, match="BOS/EOS"):
        TalkerConfig.tiny(audio_stream_bos_id=1025, audio_stream_eos_id=1024)
    with pytest.raises(ConfigError, match="positive int"):
        TalkerConfig.tiny(hidden_size=0)
    with pytest.raises(ConfigError, match="vocab_size"):
        TalkerConfig.from_hf_dict({k: v for k, v in TalkerConfig.tiny().to_hf_dict().items() if k != "vocab_size"})
    assert TalkerConfig.tiny(rope_scaling=None).rope_scaling is None
    assert TalkerConfig.tiny(rope_scaling={"rope_type": "default"}).rope_scaling is None


def test_special_tokens_from_lookup():
    vocab = {tok: 1000 + i for i, tok in enumerate(SPECIAL_TOKEN_STRINGS.values())}
    special = SpecialTokens.from_lookup(vocab.get)
    assert special.audio_out_bos == vocab["<|audio_out_bos|>"] and special.audio_out == vocab["<|AUDIO_OUT|>"]
    del vocab["<|scene_desc_end|>"]
    with pytest.raises(ConfigError, match="scene_desc_end"):
        SpecialTokens.from_lookup(vocab.get)
    with pytest.raises(ConfigError, match="distinct"):
        SpecialTokens(**{**SpecialTokens.consecutive(0).as_dict(), "eot": 0})
    released = SpecialTokens.llama3_layout()
    assert (released.audio_out_bos, released.audio_eos, released.audio_out) == (128013, 128012, 128016)


def test_null_rope_theta_is_the_llama3_default():
    """Higgs text configs may say `rope_theta: null` (noted by sglang-omni): Llama 3's 500000."""
    v5 = TalkerConfig.tiny(rope_theta=1e4).to_hf_dict()
    v5["rope_parameters"]["rope_theta"] = None
    assert TalkerConfig.from_hf_dict(v5).rope_theta == 500000.0
    v4 = {**TalkerConfig.tiny(rope_theta=1e4).to_hf_dict(), "rope_theta": None}
    v4.pop("rope_parameters")
    assert TalkerConfig.from_hf_dict(v4).rope_theta == 500000.0
    orig = {**ORIGINAL, "text_config": {**ORIGINAL["text_config"], "rope_theta": None}}
    assert TalkerConfig.from_original_dict(orig).rope_theta == 500000.0
