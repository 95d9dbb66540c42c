"""The GPU engine on CUDA with a small random model (head_dim 128, GQA group 3, as the 3B model).

- fast kernels (Triton + FlashInfer, bf16) track the plain-torch fp32 path on the same weights;
- graph-replayed batched decoding gives the same codes as the eager engine (same seeds);
- a batch above the largest captured bucket fails loudly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from higgs_stream.engine.cuda_graph import GraphShapeError
from higgs_stream.engine.engine import EngineConfig
from higgs_stream.engine.gpu_engine import GpuEngine, GpuEngineConfig
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.models.higgs_v2.random_weights import (
    random_reference,
    talker_from_reference,
    tokenizer_and_config,
)
from higgs_stream.engine.request import GenerationRequest, SamplingParams

from higgs_stream.bench_model import logprob_parity

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DIMS = dict(hidden_size=768, intermediate_size=1536, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=128)


@pytest.fixture(scope="module")
def model():
    tok, cfg = tokenizer_and_config("tiny", **DIMS)
    hf = random_reference(cfg, "cuda", seed=1, std=0.05)
    return tok, cfg, hf


def engine(model, dtype=torch.bfloat16, gpu=None, max_batch=8, fast=None, talker=None):
    tok, cfg, hf = model
    talker = talker or talker_from_reference(hf, cfg, dtype)
    cache = KVCache.create(cfg, num_pages=400, page_size=16, dtype=dtype, device="cuda")
    return GpuEngine(talker, cfg, tok, cache, EngineConfig(max_batch=max_batch, kv_pages=400, max_seq_len=1024),
                     gpu or GpuEngineConfig(graph_buckets=(1, 2, 4, 8)), fast=fast)


def test_bf16_fast_path_tracks_fp32_reference(model):
    res = logprob_parity(model[2], engine(model), steps=12)
    assert res["mean_abs_delta_nat"] < 0.03 and res["p99_abs_delta_nat"] < 0.15, res


def reqs(ras_window: int) -> list[GenerationRequest]:
    return [GenerationRequest(text="Hello world. " * (1 + 3 * i), max_frames=60,
                              sampling=SamplingParams(temperature=0.0, seed=10 + i, ras_window=ras_window))
            for i in range(4)]


def run(eng, reqs):
    """Every request's codec frames [8, F], all added at once."""
    sids = {eng.add(r): i for i, r in enumerate(reqs)}
    frames = {i: [] for i in range(len(reqs))}
    while eng.has_work():
        for ev in eng.step():
            if ev.frame is not None:
                frames[sids[ev.stream_id]].append(ev.frame)
    return [np.stack(frames[i], axis=1) if frames[i] else np.zeros((8, 0), np.int64) for i in range(len(reqs))]


@pytest.mark.parametrize("ras_window", [0, 7])
def test_graphs_equal_eager(model, ras_window):
    """4 streams (= a bucket, so the eager step multiplies the same M rows as the graph) run to the
    frame cap (EOS rows of the random head zeroed): graph replay == eager, frame for frame."""
    graphed = engine(model)
    cfg = graphed.cfg
    graphed.fast.audio_head.view(cfg.num_codebooks, cfg.audio_vocab, -1)[:, cfg.audio_stream_eos_id] = 0
    eager = engine(model, gpu=GpuEngineConfig(cuda_graphs=False), fast=graphed.fast, talker=graphed.talker)
    a, b = run(graphed, reqs(ras_window)), run(eager, reqs(ras_window))
    for x, y in zip(a, b):
        assert x.shape[1] == 60 and np.array_equal(x, y)  # the frame cap (69 delay-pattern columns)
    sampled = [GenerationRequest(text="Hi there.", max_frames=30, sampling=SamplingParams(seed=3, temperature=0.9))] * 4
    s = run(graphed, sampled)
    assert all(np.array_equal(s[0], x) for x in s[1:])  # same request + seed, same codes
    assert np.array_equal(s[0], run(eager, sampled)[0])


def test_batch_above_largest_bucket_raises(model):
    eng = engine(model, gpu=GpuEngineConfig(graph_buckets=(1, 2, 4, 8)))
    with pytest.raises(GraphShapeError):
        eng.graphs.bucket_for(9)


def test_batched_greedy_codes_equal_each_stream_alone(model):
    """6 streams of different prompt lengths admitted together, 200 greedy frames each: the graphed
    batched engine (bucket 8) gives every stream the codes of the eager batch-1 engine. Prompts are
    prefilled one sequence per forward, so nothing but the decode step is shared, and decode steps
    are batch-invariant (teacher-forced logits checked first)."""
    from higgs_stream.bench_model import batch_vs_single

    graphed = engine(model)
    cfg = graphed.cfg
    graphed.fast.audio_head.view(cfg.num_codebooks, cfg.audio_vocab, -1)[:, cfg.audio_stream_eos_id] = 0
    alone = engine(model, gpu=GpuEngineConfig(cuda_graphs=False), max_batch=1, fast=graphed.fast,
                   talker=graphed.talker)
    tf = batch_vs_single(graphed, alone)
    assert tf["max_abs_delta_logit"] == 0.0, tf
    texts = ["Hi. " * (1 + 5 * i) for i in range(6)]
    requests = [GenerationRequest(text=t, max_frames=200, sampling=SamplingParams(temperature=0.0, seed=20 + i))
                for i, t in enumerate(texts)]
    together = run(graphed, requests)
    for i, r in enumerate(requests):
        want = alone.generate(r)
        assert together[i].shape == want.shape == (8, 200), (i, together[i].shape, want.shape)
        diff = np.nonzero((together[i] != want).any(axis=0))[0]
        assert diff.size == 0, f"stream {i} differs from frame {diff[0]}"
