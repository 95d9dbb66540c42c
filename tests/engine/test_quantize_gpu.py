"""The quantized fast path on CUDA, with the small random v2 model of test_model_runner_gpu.py
(head_dim 128, GQA group 3, bf16):

- int8 / fp8 with the fast kernels (Triton, torch's scaled GEMM, CUDA graphs) track the same
  quantized weights run through the plain-torch definitions (teacher-forced audio log-probs);
- against transformers' fp32 reference, within the bounds the CPU emulation of this very model
  measured (int8: mean 0.053 nat, p99 0.17; fp8: mean 0.26, p99 0.85; random weights of std 0.05
  amplify every perturbation through the layers), times ~1.7 for bf16 activations;
- graph replay == eager frame for frame; every stream ends at the frame cap with EOS suppressed
  ("length"), and by EOS or the cap when sampled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.bench_model import compare_logits, end_of_speech_guard, fast_logits, logprob_parity, parity_request
from higgs_stream.engine.cuda_graph import FP8_BUCKETS
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.models.higgs_v2.random_weights import (
    random_reference,
    talker_from_reference,
    tokenizer_and_config,
)
from higgs_stream.engine.quantize import QuantizedWeight, quantize_talker
from higgs_stream.engine.random_weights import suppress_eos
from higgs_stream.engine.request import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DIMS = dict(hidden_size=768, intermediate_size=1536, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=128)
BOUNDS = {"int8": (0.1, 0.35), "fp8": (0.45, 1.5)}  # mean, p99 |delta log-prob| vs the fp32 reference
# mean, p99 |delta log-prob|, fast kernels vs the plain-torch definitions on the same quantized weights.
# int8 is weight-only: the two differ by bf16 summation order, the bf16 fast path's own bound. fp8
# re-quantizes every activation to e4m3 (3 mantissa bits): a bf16 summation-order difference that
# moves a value across an e4m3 rounding boundary becomes a 2^-4 step, so the two differ by fp8
# rounding noise (first GPU run: mean 0.124, p99 0.41 nat), about half of fp8's own error vs fp32.
SELF_BOUNDS = {"int8": (0.03, 0.15), "fp8": (0.2, 0.6)}


def modes() -> list[str]:
    fp8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    return ["int8", "fp8"] if fp8 else ["int8"]


@pytest.fixture(scope="module")
def model():
    tok, cfg = tokenizer_and_config("tiny", **DIMS)
    return tok, cfg, random_reference(cfg, "cuda", seed=1, std=0.05)


def engine(model, mode: str, kernels: str = "fast", gpu: ModelRunnerConfig | None = None, fast=None,
           talker=None) -> Engine:
    tok, cfg, hf = model
    if talker is None:
        talker = talker_from_reference(hf, cfg, torch.bfloat16)
        quantize_talker(talker, mode, kernels)
    cache = KVCache.create(cfg, num_pages=400, page_size=16, dtype=torch.bfloat16, device="cuda")
    gpu = gpu or (ModelRunnerConfig(graph_buckets=(1, 2, 4, 8)) if kernels == "fast"
                  else ModelRunnerConfig(kernels="ref", cuda_graphs=False))
    return Engine(talker, cfg, tok, cache, EngineConfig(max_batch=8, kv_pages=400, max_seq_len=1024), gpu, fast=fast)


@pytest.mark.parametrize("mode", modes())
def test_fast_kernels_track_the_definitions_on_the_same_weights(model, mode):
    fast, ref = engine(model, mode), engine(model, mode, kernels="ref")
    assert isinstance(fast.runner.fast.layers[0].qkv, QuantizedWeight)
    prompt = fast.policy.build_prompt(parity_request())
    ours, cols = fast_logits(fast, prompt, 12)  # greedy, graph replays
    want, _ = fast_logits(ref, prompt, 12, cols)
    r = compare_logits(ours, want)
    mean, p99 = SELF_BOUNDS[mode]
    assert r["mean_abs_delta_nat"] < mean and r["p99_abs_delta_nat"] < p99, r


@pytest.mark.parametrize("mode", modes())
def test_quantized_fast_path_vs_fp32_reference(model, mode):
    res = logprob_parity(model[2], engine(model, mode), steps=12)
    mean, p99 = BOUNDS[mode]
    assert 1e-3 < res["mean_abs_delta_nat"] < mean and res["p99_abs_delta_nat"] < p99, res


@pytest.mark.parametrize("mode, buckets", [(m, (1, 2, 4, 8)) for m in modes()]
                         + [("fp8", tuple(b for b in FP8_BUCKETS if b <= 16))] * ("fp8" in modes()))
def test_graphs_equal_eager_and_streams_end_at_the_cap(model, mode, buckets):
    """Also with fp8's own buckets (engine/cuda_graph.py: FP8_BUCKETS), where the 4 streams replay the 16-row graph:
    its 12 padding rows change nothing in the real ones."""
    graphed = engine(model, mode, gpu=ModelRunnerConfig(graph_buckets=buckets))
    suppress_eos(graphed)
    eager = engine(model, mode, gpu=ModelRunnerConfig(cuda_graphs=False), fast=graphed.runner.fast,
                   talker=graphed.talker)
    reqs = [GenerationRequest(text="Hello world. " * (1 + 3 * i), max_frames=60,
                              sampling=SamplingParams(temperature=0.0, seed=10 + i, ras_window=0)) for i in range(4)]

    def run(eng):
        sids = {eng.add(r): i for i, r in enumerate(reqs)}
        frames = {i: [] for i in range(len(reqs))}
        while eng.has_work():
            for ev in eng.step():
                if ev.frame is not None:
                    frames[sids[ev.stream_id]].append(ev.frame)
        return [np.stack(frames[i], axis=1) for i in range(len(reqs))]

    for x, y in zip(run(graphed), run(eager)):
        assert x.shape == (8, 60) and np.array_equal(x, y)
    res = end_of_speech_guard(graphed, n=8, max_frames=80)
    assert res["length"] == 8 and res["length_at_cap"] and res["runaway"] == 0, res


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 pages need compute capability >= 8.9")
def test_fp8_kv_pages(model):
    """--kv-cache-dtype fp8 (bf16 weights): graph replay == eager; vs the fp32 reference within what the
    CPU emulation of this model measured (mean 0.11 nat, p99 0.38) with room for bf16; streams end at the cap."""
    tok, cfg, hf = model
    talker = talker_from_reference(hf, cfg, torch.bfloat16)

    def kv8(gpu, fast=None):
        cache = KVCache.create(cfg, num_pages=400, page_size=16, dtype=torch.float8_e4m3fn, device="cuda")
        return Engine(talker, cfg, tok, cache, EngineConfig(max_batch=8, kv_pages=400, max_seq_len=1024), gpu, fast=fast)

    graphed = kv8(ModelRunnerConfig(graph_buckets=(1, 2, 4, 8)))
    res = logprob_parity(hf, graphed, steps=12)
    assert 1e-3 < res["mean_abs_delta_nat"] < 0.2 and res["p99_abs_delta_nat"] < 0.65, res
    eager = kv8(ModelRunnerConfig(cuda_graphs=False), fast=graphed.runner.fast)
    suppress_eos(graphed)
    reqs = [GenerationRequest(text="Hello world. " * (1 + 3 * i), max_frames=40,
                              sampling=SamplingParams(temperature=0.0, seed=i, ras_window=0)) for i in range(4)]
    for eng in (graphed, eager):
        for r in reqs:
            eng.add(r)
    # the same requests, one engine after the other: graphed (bucket 4) vs eager (4 rows)
    got = {}
    for name, eng in (("graphed", graphed), ("eager", eager)):
        frames = {}
        while eng.has_work():
            for ev in eng.step():
                if ev.frame is not None:
                    frames.setdefault(ev.stream_id, []).append(ev.frame)
        got[name] = [np.stack(frames[s], axis=1) for s in sorted(frames)]
    for x, y in zip(got["graphed"], got["eager"]):
        assert x.shape == (8, 40) and np.array_equal(x, y)
    res = end_of_speech_guard(graphed, n=8, max_frames=60)
    assert res["length"] == 8 and res["length_at_cap"] and res["runaway"] == 0, res


@pytest.mark.parametrize("mode", modes())
def test_sampled_streams_end_by_eos_or_the_cap(model, mode):
    res = end_of_speech_guard(engine(model, mode), n=8, max_frames=120, temperature=1.0)
    assert res["all_ended_by_eos_or_cap"] and res["runaway"] == 0, res


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 needs compute capability >= 8.9")
def test_fused_fp8_quantization_gives_the_same_logits(model):
    """ModelRunnerConfig.fuse_fp8_quant: the norms and SiLU write the e4m3 activations of the fp8 linears after them
    (prefill chunks here: more rows than the weight-only GEMV takes). The same bytes as the unfused launches, so the
    same logits, bit for bit, at the prompt's end and after each teacher-forced decode step."""
    assert ModelRunnerConfig().fuse_fp8_quant  # the default
    plain = engine(model, "fp8", gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), fuse_fp8_quant=False))
    fused = engine(model, "fp8", gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), fuse_fp8_quant=True),
                   talker=plain.talker)
    assert fused.runner.fast.fuse_fp8 and not plain.runner.fast.fuse_fp8
    prompt = plain.policy.build_prompt(parity_request())
    assert len(prompt) // 2 > 16  # both prefill chunks on the scaled GEMM's row counts
    want, cols = fast_logits(plain, prompt, 4)
    got, _ = fast_logits(fused, prompt, 4, cols)
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 needs compute capability >= 8.9")
@pytest.mark.parametrize("mode", ["fp8", "int8"])
def test_cuda_core_gemv_tracks_the_tensor_core_kernel(model, mode):
    """ModelRunnerConfig.cuda_core_gemv_rows: the decode steps of one row run the quantized linears on the CUDA-core
    GEMV. The same weight-only product summed in another order: the teacher-forced logits after each decode step
    within fp32/bf16 rounding of the tensor-core kernel's (prefill chunks are above its rows: the same kernels)."""
    assert ModelRunnerConfig().cuda_core_gemv_rows == 2  # the default
    plain = engine(model, mode, gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), cuda_core_gemv_rows=0))
    gemv = engine(model, mode, gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), cuda_core_gemv_rows=4),
                  talker=plain.talker)
    assert gemv.runner.fast.cuda_core_gemv_rows == 4 and plain.runner.fast.cuda_core_gemv_rows == 0
    prompt = plain.policy.build_prompt(parity_request())
    want, cols = fast_logits(plain, prompt, 4)
    got, _ = fast_logits(gemv, prompt, 4, cols)
    rel = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert rel < 2e-2, rel  # bf16 activations between layers: a few bf16 ulps of the logits' peak


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs compute capability >= 9.0")
@pytest.mark.parametrize("mode", ["none", "fp8"])
def test_programmatic_dependent_launch_gives_the_same_logits(model, mode):
    """ModelRunnerConfig.pdl_max_rows: the decode graphs captured with the Triton kernels' programmatic dependent
    launches give the teacher-forced logits of the graphs without, bit for bit (the same kernels on the same inputs;
    only when each may start changes), at one row (fp8: the CUDA-core GEMV; the ranged decode and its merge; norms,
    RoPE, SiLU). The switch is on only while the graphs are captured."""
    from higgs_stream.kernels import _triton

    buckets = (1, 2, 4, 8)
    plain = engine(model, mode, gpu=ModelRunnerConfig(graph_buckets=buckets, pdl_max_rows=0))
    assert plain.runner.pdl_max_rows == 0
    prompt = plain.policy.build_prompt(parity_request())
    want, cols = fast_logits(plain, prompt, 8)
    pdl = engine(model, mode, gpu=ModelRunnerConfig(graph_buckets=buckets, pdl_max_rows=8), talker=plain.talker)
    assert pdl.runner.pdl_max_rows == 8
    assert _triton.pdl_args() == {"PDL": False, "launch_pdl": False}  # eager launches (prompts) keep it off
    got, _ = fast_logits(pdl, prompt, 8, cols)
    assert torch.equal(got, want)
