"""Quantize-on-load (engine/quantize.py) on the tiny v2 and v3 checkpoints, on the CPU.

- Plumbing: `--quantize int8|fp8` replaces exactly the family's backbone linears (int8 / e4m3 values
  with fp32 per-output-channel scales); every other tensor of the talker (audio embeddings, audio head,
  v3's tied table, text embedding and head, norms) is bit-for-bit the one loaded, and the fast path
  reads the quantized storage itself (no second copy). A family naming a layer that must stay in
  high precision (the audio head) is refused.
- Numerics, measured on the tiny random models (AMD EPYC, torch 2.11; bounds below with room for
  other CPUs): teacher-forced audio log-probs over the reference's top-64 ids, int8 / fp8 (emulated):
  v2 vs transformers' fp32 reference: mean |d| 0.009 / 0.046 nat, p99 0.032 / 0.16, argmax agreement
  0.975 / 0.85; v3 vs our fp32 path: mean 0.005 / 0.034, p99 0.019 / 0.14, agreement 0.99 / 0.95.
  Random tiny weights leave the top two of 1026 logits close (median margin 0.15-0.5 nat), so greedy
  columns (8 codebooks each) soon differ: through the engine, int8 greedy codes equal fp32's for the
  first 0-9 frames (v2) and 0-60 frames (v3) depending on the request (pinned: one of each); fp8
  differs from frame 0-1.
- The end-of-speech guard under every mode and both runners: EOS suppressed, every stream ends at
  its frame cap with reason "length"; sampled with EOS reachable, every stream ends by "stop" or
  "length".
- Typed errors: an unknown mode; fp8 without a GPU of compute capability >= 8.9 (naming it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from higgs_stream.bench_model import compare_logits, end_of_speech_guard, fast_logits, logprob_parity, parity_request
from higgs_stream.engine.engine import Engine, EngineConfig, load_engine
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.quantize import QuantizedWeight, QuantLinear, check_supported, quantize_talker
from higgs_stream.engine.random_weights import suppress_eos
from higgs_stream.engine.request import GenerationRequest, SamplingParams

REF = ModelRunnerConfig(kernels="ref", cuda_graphs=False)  # the fast path's step logic, plain-torch kernels
CFG = EngineConfig(max_batch=4, kv_pages=128)
FIXTURE = {"v2": "tiny_ckpt", "v3": "tiny_v3_ckpt"}
QDTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# tensors that must stay exactly as loaded (by checkpoint key), besides every norm
KEPT = {"v2": ["model.embed_audio_tokens.embed_audio_tokens.weight", "audio_lm_head.weight", "text_lm_head.weight",
               "model.embed_tokens.weight"],
        "v3": ["tied.embedding.modality_embeddings.0.embedding.weight", "tied.embedding.text_embedding.weight"]}


def load(request, arch: str, mode: str = "none", runner: ModelRunnerConfig | None = None) -> Engine:
    return Engine.from_pretrained(str(request.getfixturevalue(FIXTURE[arch])), config=CFG, runner=runner,
                                  quantize=mode)


# ------------------------------------------------------------------------------ plumbing
@pytest.mark.parametrize("arch", ["v2", "v3"])
@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_only_backbone_linears_are_quantized(request, arch, mode):
    base = load(request, arch).talker.state_dict()
    eng = load(request, arch, mode, REF)  # fp8 runs here emulated (kernels="ref")
    talker, cfg = eng.talker, eng.cfg
    names = set(talker.backbone_linears())
    per_layer = 10 if arch == "v2" else 7  # q, k, v, o + (text and audio | one) gate, up, down
    assert len(names) == per_layer * cfg.num_layers
    quantized = {n for n, m in talker.named_modules() if isinstance(m, QuantLinear)}
    assert quantized == names
    got = talker.state_dict()
    for name in names:
        w, s = got.pop(f"{name}.weight"), got.pop(f"{name}.weight_scale")
        want = base.pop(f"{name}.weight")
        assert w.dtype == QDTYPE[mode] and w.shape == want.shape and s.dtype == torch.float32 and s.shape == (w.shape[0],)
        step = s[:, None] / 2 if mode == "int8" else torch.maximum(want.abs() / 16, s[:, None] * 2.0**-10)
        assert ((w.float() * s[:, None] - want).abs() <= step + 1e-6 * want.abs()).all()  # half a step (+ fp32 rounding)
    assert set(got) == set(base)  # nothing else added or removed...
    for key, t in base.items():  # ... or changed: same dtype, same bits
        assert got[key].dtype == t.dtype and torch.equal(got[key], t), key
    norms = [k for k in base if "norm" in k]
    assert len(norms) >= 2 * cfg.num_layers + 1 and all(k in base for k in KEPT[arch])  # checked unchanged above
    for key in KEPT[arch]:  # the layers that must stay unquantized are still plain modules, fp32 as loaded
        module = talker.get_submodule(key.rpartition(".")[0])
        assert type(module) in (nn.Embedding, nn.Linear) and module.weight.dtype == torch.float32, key


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_the_fast_path_reads_the_quantized_storage(request, arch):
    eng = load(request, arch, "int8", REF)
    fast, talker = eng.runner.fast, eng.talker
    layer, attn = fast.layers[0], talker.backbone_linears()
    prefix = "model.layers.0" if arch == "v2" else "body.layers.0"
    assert isinstance(layer.qkv, QuantizedWeight) and layer.qkv.mode == "int8"
    q_proj = attn[f"{prefix}.self_attn.q_proj"]
    assert q_proj.weight.data_ptr() == layer.qkv.qweight.data_ptr()  # a view of the fused matrix: one copy
    assert q_proj.weight_scale.data_ptr() == layer.qkv.scale.data_ptr()
    assert all(isinstance(w, QuantizedWeight) for w in (layer.o, *layer.gate_up, *layer.down))
    assert fast.audio_head.dtype == torch.float32 and not isinstance(fast.audio_head, QuantizedWeight)
    if arch == "v3":
        assert fast.audio_head is fast.embed_audio  # the tied table: one fp32 matrix, embedding and head
    # the audio step's weight bytes: each fp32 weight (4 bytes) of the linears it reads became 1 byte,
    # plus a 4-byte scale per output row
    plain = load(request, arch, "none", REF).runner.fast
    assert fast.quantized and not plain.quantized  # what the runner's PDL default reads (default_pdl_max_rows)
    saved = sum(3 * w.numel() - 4 * w.shape[0] for lay in plain.layers
                for w in (lay.qkv, lay.o, lay.gate_up[-1], lay.down[-1]))
    assert plain.audio_step_bytes() - fast.audio_step_bytes() == saved > 0


def test_a_family_naming_a_high_precision_layer_is_refused(request):
    talker = load(request, "v2").talker
    linears = talker.backbone_linears()
    talker.backbone_linears = lambda: {**linears, "audio_lm_head": talker.audio_lm_head}
    with pytest.raises(ConfigError, match="audio_lm_head is the audio head"):
        quantize_talker(talker, "int8")
    v3 = load(request, "v3").talker
    table = "tied.embedding.modality_embeddings.0.embedding"
    v3.backbone_linears = lambda: {table: v3.get_submodule(table)}
    with pytest.raises(ConfigError, match="only bias-free nn.Linear"):
        quantize_talker(v3, "int8")
    twice = load(request, "v3", "int8").talker
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_talker(twice, "int8")


def mixed_step(talker, cfg, fast: bool):
    """Audio logits of one ragged step (text and audio rows, two sequences): talker.forward (the
    reference runner's model) and, with `fast`, FastTalker over the same talker (ref kernels)."""
    from higgs_stream.engine.batch import StepBatch
    from higgs_stream.engine.fast_talker import FastInputs, FastTalker
    from higgs_stream.engine.kv_cache import KVCache
    from higgs_stream.kernels.flashinfer_attention import RefAttention

    gen = torch.Generator().manual_seed(0)
    is_audio = torch.tensor([False] * 4 + [True] * 7)
    ids, codes = torch.randint(0, 200, (11,), generator=gen), torch.randint(0, 1026, (11, 8), generator=gen)
    positions = torch.cat([torch.arange(6), torch.arange(5)])
    cache = KVCache.create(cfg, num_pages=16, page_size=4)
    cache.allocator.reserve(0, 6)
    cache.allocator.reserve(1, 5)
    if not fast:
        batch = StepBatch(seq_ids=[0, 1], qo_lens=[6, 5], input_ids=ids, audio_codes=codes, is_audio=is_audio,
                          positions=positions, want_text=torch.zeros(2, dtype=torch.bool),
                          want_audio=torch.ones(2, dtype=torch.bool))
        return talker.forward(batch, cache).audio_logits
    layout = cache.layout([0, 1], [6, 5])
    attn = RefAttention(cfg.head_dim)
    attn.plan_layout(layout)
    inp = FastInputs(text_ids=ids, codes=codes, positions=positions, kv_slots=layout.slot_mapping,
                     out_rows=layout.last_token_index, audio_rows=is_audio.nonzero().flatten(),
                     text_rows=(~is_audio).nonzero().flatten(), select=is_audio.int())
    with torch.no_grad():
        return FastTalker(talker, "ref").forward(inp, attn, cache.pool.k, cache.pool.v)


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_both_runners_compute_the_same_int8_model(request, arch):
    """One mixed step: the reference runner's talker with the int8 definition == the fast path's fused
    int8 weights (ref kernels) to fp32 rounding; with ATen's CPU kernel (what `--quantize int8` runs on
    the CPU: bf16 activations inside the int8 linears) within 1% of the logits' range (measured 0.3%)."""
    eng = load(request, arch, "int8")
    talker, cfg = eng.talker, eng.cfg
    aten = mixed_step(talker, cfg, fast=False)
    for m in talker.modules():
        if isinstance(m, QuantLinear):
            m.kernels = "ref"
    definition = mixed_step(talker, cfg, fast=False)
    fused = mixed_step(talker, cfg, fast=True)
    torch.testing.assert_close(fused, definition, rtol=1e-5, atol=1e-5)
    spread = (definition.max() - definition.min()).item()
    assert 0 < (aten - definition).abs().max().item() < 1e-2 * spread


# ------------------------------------------------------------------------------ numerics
def test_v2_logprobs_vs_the_transformers_fp32_reference():
    """Teacher-forced on our own greedy columns (24 steps), tiny v2 with std-0.1 weights."""
    from higgs_stream.engine.kv_cache import KVCache
    from higgs_stream.engine.models.higgs_v2.random_weights import (
        random_reference,
        talker_from_reference,
        tokenizer_and_config,
    )

    tok, cfg = tokenizer_and_config("tiny")
    hf = random_reference(cfg, "cpu", std=0.1)
    res = {}
    for mode in ("none", "int8", "fp8"):
        talker = talker_from_reference(hf, cfg, torch.float32)
        quantize_talker(talker, mode, kernels="ref")
        eng = Engine(talker, cfg, tok, KVCache.create(cfg, 64, 16), EngineConfig(max_batch=2, kv_pages=64), REF)
        res[mode] = logprob_parity(hf, eng, steps=24, columns="greedy")
    assert res["none"]["mean_abs_delta_nat"] < 1e-5 and res["none"]["greedy_parity_steps"] == 25, res["none"]
    for mode, mean, p99, agree in (("int8", 0.015, 0.05, 0.93), ("fp8", 0.08, 0.3, 0.75)):
        r = res[mode]
        assert 1e-4 < r["mean_abs_delta_nat"] < mean and r["p99_abs_delta_nat"] < p99, (mode, r)
        assert r["argmax_agreement"] >= agree, (mode, r)
    assert res["int8"]["mean_abs_delta_nat"] < res["fp8"]["mean_abs_delta_nat"] / 2  # weight-only int8 is the closer


def test_v3_logprobs_vs_its_fp32_path(request):
    """Teacher-forced on the quantized engine's greedy columns (32 steps), against the unquantized
    fp32 fast path fed the same columns (which equals Qwen3 + the tied head to ~1e-6)."""
    base = load(request, "v3", "none", REF)
    prompt = base.policy.build_prompt(parity_request())
    for mode, mean, p99, agree in (("int8", 0.012, 0.04, 0.95), ("fp8", 0.06, 0.25, 0.85)):
        ours, fed = fast_logits(load(request, "v3", mode, REF), prompt, 32)
        ref, _ = fast_logits(base, prompt, 32, fed)
        r = compare_logits(ours, ref)
        assert 1e-4 < r["mean_abs_delta_nat"] < mean and r["p99_abs_delta_nat"] < p99, (mode, r)
        assert r["argmax_agreement"] >= agree, (mode, r)


@pytest.mark.parametrize("arch, text, frames", [("v2", "Numbers like 1, 2, 3.", 5),
                                                 ("v3", "Good morning! How are you today?", 30)])
def test_int8_greedy_codes_agree_with_fp32(request, arch, text, frames):
    """Through the engine (ramps, frame cap, RAS off), both runners: the first `frames` codec frames of
    int8 equal fp32's (measured on an AMD EPYC: v2 the first 8 frames with either runner, v3 all 60)."""
    req = GenerationRequest(text=text, max_frames=60, sampling=SamplingParams(temperature=0.0, ras_window=0))
    want = load(request, arch).generate(req)
    assert want.shape[1] >= frames
    for runner in (None, REF):
        got = load(request, arch, "int8", runner).generate(req)
        assert got.shape[1] >= frames and np.array_equal(got[:, :frames], want[:, :frames]), runner


# ------------------------------------------------------------------------------ end of speech
CASES = [("none", None), ("int8", None), ("none", REF), ("int8", REF), ("fp8", REF)]


@pytest.mark.parametrize("arch", ["v2", "v3"])
@pytest.mark.parametrize("mode, runner", CASES, ids=[f"{m}-{'model' if r else 'ref'}-runner" for m, r in CASES])
def test_a_forced_runaway_ends_at_the_frame_cap(request, arch, mode, runner):
    eng = load(request, arch, mode, runner)
    suppress_eos(eng)  # EOS can never be sampled: only the cap can end these streams
    res = end_of_speech_guard(eng, n=3, max_frames=24)
    assert res["length"] == 3 and res["runaway"] == 0 and res["frames_max"] == 24 and res["length_at_cap"], res
    assert eng.cache.allocator.num_used == (1 if runner else 0)  # only the ModelRunner's scratch page is held


@pytest.mark.parametrize("arch", ["v2", "v3"])
@pytest.mark.parametrize("mode, runner", [("int8", None), ("fp8", REF)])
def test_sampled_streams_end_by_eos_or_the_cap(request, arch, mode, runner):
    res = end_of_speech_guard(load(request, arch, mode, runner), n=4, max_frames=40, temperature=0.9)
    assert res["all_ended_by_eos_or_cap"] and res["runaway"] == 0 and res["other"] == 0, res


# ------------------------------------------------------------------------------ errors
def test_unknown_mode_is_a_config_error(tiny_ckpt):
    with pytest.raises(ConfigError, match="unknown quantize mode 'int4'"):
        load_engine(str(tiny_ckpt), quantize="int4")
    with pytest.raises(ConfigError, match="unknown quantize mode"):
        Engine.from_pretrained(str(tiny_ckpt), quantize="fp4")


def test_fp8_needs_compute_capability_8_9(monkeypatch):
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9 \(Ada, Hopper\); the model is on cpu"):
        load_engine("/no/such/checkpoint", device="cpu", quantize="fp8")  # refused before reading anything
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"NVIDIA A100-SXM4-80GB\) has compute capability 8\.0: use --quantize int8"):
        check_supported("fp8", torch.device("cuda:0"), torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_supported("fp8", torch.device("cuda:0"), torch.bfloat16)  # Hopper, bf16: fine
    with pytest.raises(ConfigError, match="bfloat16"):
        check_supported("fp8", torch.device("cuda:0"), torch.float16)
    check_supported("fp8", torch.device("cpu"), torch.float32, kernels="ref")  # emulated: any device
    check_supported("int8", torch.device("cpu"), torch.float32)
