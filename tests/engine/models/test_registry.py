"""model_type -> family dispatch: talker, tokenizer, generation policy and codec of v2 and v3 checkpoints."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from higgs_stream.engine import codec as codec_pkg
from higgs_stream.engine.checkpoint_writer import write_checkpoint
from higgs_stream.engine.codec import DEFAULT_HUB_ID, load_codec
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.models.higgs_v2.config import SpecialTokens, TalkerConfig
from higgs_stream.engine.models.higgs_v2.policy import V2Policy, V2Segment
from higgs_stream.engine.models.higgs_v2.talker import Talker
from higgs_stream.engine.models.higgs_v3.checkpoint import load_codec_v3
from higgs_stream.engine.models.higgs_v3.config import TalkerV3Config, V3SpecialTokens
from higgs_stream.engine.models.higgs_v3.policy import V3Policy, V3Segment
from higgs_stream.engine.models.higgs_v3.talker import TalkerV3
from higgs_stream.engine.models.registry import (
    FAMILIES,
    family_named,
    family_of_config,
    family_of_dir,
    load_codec_for,
    model_arch,
)
from higgs_stream.engine.request import GenerationRequest, SamplingParams


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_model_arch_from_model_type(tiny_ckpt, tiny_ckpt_original, tiny_v3_ckpt, tmp_path):
    assert [model_arch(d) for d in (tiny_ckpt, tiny_ckpt_original, tiny_v3_ckpt)] == ["v2", "v2", "v3"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="unknown model_type 'llama'.*higgs_multimodal_qwen3"):
        model_arch(tmp_path)


def test_from_pretrained_dispatches_on_model_type(tiny_ckpt, tiny_v3_ckpt):
    config = EngineConfig(max_batch=2, kv_pages=32, max_seq_len=1000)
    v2 = Engine.from_pretrained(str(tiny_ckpt), config=config)
    v3 = Engine.from_pretrained(str(tiny_v3_ckpt), config=config)
    assert (type(v2.talker), type(v2.cfg), type(v2.policy), type(v2.tokenizer.special)) == \
        (Talker, TalkerConfig, V2Policy, SpecialTokens)
    assert (type(v3.talker), type(v3.cfg), type(v3.policy), type(v3.tokenizer.special)) == \
        (TalkerV3, TalkerV3Config, V3Policy, V3SpecialTokens)
    assert v2.talker.max_positions == v3.talker.max_positions == 1000
    assert v2.cache.pool.k.dtype == v3.cache.pool.k.dtype == torch.float32
    # the seam's per-family answers
    req = GenerationRequest(text="Hello world.", sampling=SamplingParams(seed=0), max_frames=4)
    p2, p3 = v2.policy.build_prompt(req), v3.policy.build_prompt(req)
    # every decode step feeds the continuation token on the text track (no per-step text)
    assert p2.text_track.size == p3.text_track.size == 0
    assert p2.step_text_id(0) == p2.step_text_id(99) == v2.tokenizer.special.audio_out
    assert p3.step_text_id(0) == p3.step_text_id(99) == v3.tokenizer.special.audio
    assert not v2.policy.sample_at_prompt_end and v3.policy.sample_at_prompt_end
    assert v2.policy.head_codebooks == v3.policy.head_codebooks == 8  # whole rows from the head
    seg2 = v2.policy.new_segment(v2.policy.build_prompt(req), req.sampling, 4)
    seg3 = v3.policy.new_segment(v3.policy.build_prompt(req), req.sampling, 4)
    assert isinstance(seg2, V2Segment) and isinstance(seg3, V3Segment)
    assert seg2.start() == seg3.start() == []  # neither emits a start row (v2's all-BOS column is fed back, not emitted)
    assert seg2.last_column == (1024,) * 8  # ... and it is the next step's input
    # each family's writer: v2 starts from that column (frame n comes with column n + 8), v3 from row 0 (frame n with row n + 7)
    w2, w3 = v2.policy.new_writer(), v3.policy.new_writer()
    assert [w2.push((5,) * 8) for _ in range(8)][-1] == [5] * 8 and w2.num_columns == 9
    assert [w3.push((5,) * 8) for _ in range(8)][-2:] == [None, [5] * 8]
    # dtype=None keeps the stored dtype (fp32 here), bf16 casts the backbone and the cache
    bf16 = Engine.from_pretrained(str(tiny_v3_ckpt), dtype=torch.bfloat16, config=config)
    assert bf16.talker.dtype == bf16.cache.pool.k.dtype == torch.bfloat16
    assert bf16.talker.audio.embedding.weight.dtype == torch.bfloat16  # the fused matrix too (cast like the backbone)


def test_family_and_policy_reject_other_configs(tiny_ckpt):
    engine = Engine.from_pretrained(str(tiny_ckpt), config=EngineConfig(max_batch=2, kv_pages=8))
    assert (family_of_config(TalkerConfig.tiny()).arch, family_of_config(TalkerV3Config.tiny()).arch) == ("v2", "v3")
    assert engine.family is family_named("v2") and isinstance(engine.policy, V2Policy)
    with pytest.raises(ConfigError, match="no model family for a dict"):
        family_of_config({})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no model family for a dict"):
        Engine(engine.talker, {}, engine.tokenizer, engine.cache)  # type: ignore[arg-type]


def test_one_package_per_family_and_one_family_per_model_type():
    """Each family is the package named after it, and no name, arch or model_type is claimed twice."""
    for f in FAMILIES:
        assert type(f).__module__ == f"higgs_stream.engine.models.{f.name}"
        assert family_named(f.arch) is f
    for attr in ("name", "arch"):
        assert len({getattr(f, attr) for f in FAMILIES}) == len(FAMILIES)
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(types) == len(set(types))


def test_load_codec_for_each_source(tiny_ckpt, tiny_ckpt_original, tiny_v3_ckpt, tmp_path, monkeypatch):
    # v3: the bundled codec; an explicit codec is refused rather than silently ignored
    assert same_weights(load_codec_for(tiny_v3_ckpt), load_codec_v3(tiny_v3_ckpt))
    with pytest.raises(ConfigError, match="codec bundled"):
        load_codec_for(tiny_v3_ckpt, tiny_ckpt / "audio_tokenizer")
    # v2: MODEL/audio_tokenizer, or the explicit codec
    ours = load_codec_for(tiny_ckpt)
    assert same_weights(ours, load_codec(tiny_ckpt / "audio_tokenizer"))
    explicit = load_codec_for(tiny_ckpt, tiny_ckpt_original / "audio_tokenizer")
    assert same_weights(explicit, load_codec(tiny_ckpt_original / "audio_tokenizer"))
    codes = torch.from_numpy(np.random.default_rng(0).integers(0, 1024, (1, 8, 5)))
    torch.testing.assert_close(ours.decode(codes), explicit.decode(codes), rtol=0, atol=1e-5)  # same seed, both layouts
    # v2 without a bundled codec: the hub codec (recorded, not downloaded)
    bare = tmp_path / "bare"
    shutil.copytree(tiny_ckpt, bare, ignore=shutil.ignore_patterns("audio_tokenizer"))
    asked = []
    monkeypatch.setattr(codec_pkg, "load_codec", lambda src, device="cpu": asked.append((src, device)) or "codec")
    assert load_codec_for(bare) == "codec" and asked == [(DEFAULT_HUB_ID, "cpu")]


def test_write_checkpoint_arch_and_layout(tmp_path):
    with pytest.raises(ConfigError, match="v3 checkpoints have one layout"):
        write_checkpoint(tmp_path / "a", arch="v3", layout="original")
    with pytest.raises(ConfigError, match="unknown arch 'v4'"):
        write_checkpoint(tmp_path / "b", arch="v4")
    with pytest.raises(ConfigError, match="seed"):
        write_checkpoint(tmp_path / "c", arch="v3", seed=-1)
    assert not any(tmp_path.iterdir())  # nothing written on a refused call


def test_bare_backbone_config_says_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    with pytest.raises(CheckpointError, match=r"unknown model_type 'qwen3'.*a text backbone.*nests it under "
                                              r"text_config") as e:
        family_of_dir(tmp_path)
    assert e.value.code == "checkpoint"
