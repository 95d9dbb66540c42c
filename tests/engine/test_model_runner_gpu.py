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
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import ModelRunnerConfig
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
    return Engine(talker, cfg, tok, cache, EngineConfig(max_batch=max_batch, kv_pages=400, max_seq_len=1024),
                  gpu or ModelRunnerConfig(graph_buckets=(1, 2, 4, 8)), fast=fast)


def test_bf16_fast_path_tracks_fp32_reference(model):
    res = logprob_parity(model[2], engine(model), steps=12)
    assert res["mean_abs_delta_nat"] < 0.03 and res["p99_abs_delta_nat"] < 0.15, res


@pytest.mark.parametrize("kernel", ["cuda_cores", "tensor_cores", "triton"])
def test_every_decode_kernel_tracks_fp32_reference(model, kernel):
    """Decode graphs on FlashInfer's CUDA-core or tensor-core decode (ModelRunnerConfig.triton_decode_from None,
    tensor_core_decode_from) or our Triton kernel (split in ranges at these small buckets: decode_splits) track the
    fp32 reference alike (from 1 row: the harness decodes one stream, bucket 1)."""
    opt = {"cuda_cores": {"triton_decode_from": None},
           "tensor_cores": {"tensor_core_decode_from": 1, "triton_decode_from": None},
           "triton": {"triton_decode_from": 1}}[kernel]
    eng = engine(model, gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), **opt))
    assert set(eng.runner.graphs.kernels.values()) == {kernel}
    res = logprob_parity(model[2], eng, steps=12)
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
    frame cap (EOS rows of the random head zeroed): graph replay == eager, frame for frame (both pack
    the 4 prompts into one prefill: the same packs, replayed or not). 4 copies of one sampled request
    give one set of codes with `prefill_pack=1` (packed, identical prompts at different rows of a pack
    may round differently)."""
    graphed = engine(model)
    cfg = graphed.cfg
    graphed.runner.fast.audio_head.view(cfg.num_codebooks, cfg.audio_vocab, -1)[:, cfg.audio_stream_eos_id] = 0
    eager = engine(model, gpu=ModelRunnerConfig(cuda_graphs=False), fast=graphed.runner.fast, talker=graphed.talker)
    a, b = run(graphed, reqs(ras_window)), run(eager, reqs(ras_window))
    for x, y in zip(a, b):
        assert x.shape[1] == 60 and np.array_equal(x, y)  # the frame cap (69 delay-pattern columns)
    sampled = [GenerationRequest(text="Hi there.", max_frames=30, sampling=SamplingParams(seed=3, temperature=0.9))] * 4
    one = engine(model, gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), prefill_pack=1), fast=graphed.runner.fast,
                 talker=graphed.talker)
    s = run(one, sampled)
    assert all(np.array_equal(s[0], x) for x in s[1:])  # same request + seed, same codes
    one_eager = engine(model, gpu=ModelRunnerConfig(cuda_graphs=False, prefill_pack=1), fast=graphed.runner.fast,
                       talker=graphed.talker)
    assert np.array_equal(s[0], run(one_eager, sampled)[0])


@pytest.mark.parametrize("ras_window", [0, 7])
def test_fused_rules_give_the_unfused_codes(model, ras_window):
    """ModelRunnerConfig.fuse_rules (the rules' integer part compiled, on by default on CUDA) against the plain ops:
    the same frames, greedy and sampled, replayed from the graphs, to the frame cap (EOS zeroed) and through RAS."""
    fused = engine(model)
    assert hasattr(fused.runner.state.rules.rows, "_torchdynamo_orig_callable")  # the default fuses
    cfg = fused.cfg
    fused.runner.fast.audio_head.view(cfg.num_codebooks, cfg.audio_vocab, -1)[:, cfg.audio_stream_eos_id] = 0
    plain = engine(model, gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), fuse_rules=False), fast=fused.runner.fast,
                   talker=fused.talker)
    assert not hasattr(plain.runner.state.rules.rows, "_torchdynamo_orig_callable")
    sampled = [GenerationRequest(text="Hi there. " * (1 + i), max_frames=40,
                                 sampling=SamplingParams(seed=3 + i, temperature=0.9, ras_window=ras_window))
               for i in range(3)]
    for batch in (reqs(ras_window), sampled):
        a, b = run(fused, batch), run(plain, batch)
        for x, y in zip(a, b):
            assert x.shape[1] > 0 and np.array_equal(x, y)


def test_steps_make_no_synchronizing_call(model):
    """Whole requests (admission, packed prefill, decode graphs, ends, releases) under torch's sync debug mode:
    no call makes the host wait for the device except the engine's own event waits, which the mode does not
    flag (a release once copied a host scalar into a 0-dim view and waited for every step in flight)."""
    eng = engine(model)
    idle_pages = eng.cache.allocator.num_used  # the runner's scratch page
    run(eng, reqs(0))  # warm-up: compilation, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        frames = run(eng, reqs(3))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(frames) == 4 and all(f.shape[1] > 0 for f in frames) and not eng.has_work()
    assert eng.cache.allocator.num_used == idle_pages == 1  # every stream ended and released its pages


def test_synchronous_steps_give_the_pipelined_codes(model):
    """Engine.step(sync=True) on the graphed CUDA path (the server's relaxed mode), alternating with
    pipelined steps: each sync call leaves nothing in flight, and every stream's frames equal those of
    pipelined steps only (4 sampled streams, graphs, one prompt per forward)."""
    gpu = ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), prefill_pack=1)
    sampled = [GenerationRequest(text="Hello world. " * (1 + i), max_frames=40,
                                 sampling=SamplingParams(seed=20 + i, temperature=0.9)) for i in range(4)]
    want = run(engine(model, gpu=gpu), sampled)
    eng = engine(model, gpu=gpu)
    sids = {eng.add(r): i for i, r in enumerate(sampled)}
    frames = {i: [] for i in range(len(sampled))}
    step = 0
    while eng.has_work():
        sync = (step // 5) % 2 == 1
        for ev in eng.step(sync=sync):
            if ev.frame is not None:
                frames[sids[ev.stream_id]].append(ev.frame)
        assert not (sync and eng.runner.busy)
        step += 1
    for i, w in enumerate(want):
        assert w.shape[1] > 0 and np.array_equal(np.stack(frames[i], axis=1), w)


def test_batch_above_largest_bucket_raises(model):
    eng = engine(model, gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8)))
    with pytest.raises(GraphShapeError):
        eng.runner.graphs.bucket_for(9)


def test_batched_greedy_codes_equal_each_stream_alone(model):
    """6 streams of different prompt lengths admitted together, 200 greedy frames each: the graphed
    batched engine (bucket 8) gives every stream the codes of the eager batch-1 engine. Prompts are
    prefilled one sequence per forward, so nothing but the decode step is shared, and decode steps
    are batch-invariant (teacher-forced logits checked first). `prefill_pack=1`: the batch-invariant
    prefill (packed first chunks are checked in test_packed_prefill_tracks_one_prompt_per_forward).
    `bf16_gemv_rows=0`: the linears on cuBLAS at every row count (the GEMV that engine/gemv_choice.py may pick
    for 1-4 rows sums in another order than the 8-row steps' cuBLAS; its own invariance over 1-4 rows:
    tests/engine/test_gemv_choice_gpu.py)."""
    from higgs_stream.bench_model import batch_vs_single

    graphed = engine(model, gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), prefill_pack=1, bf16_gemv_rows=0))
    cfg = graphed.cfg
    graphed.runner.fast.audio_head.view(cfg.num_codebooks, cfg.audio_vocab, -1)[:, cfg.audio_stream_eos_id] = 0
    alone = engine(model, gpu=ModelRunnerConfig(cuda_graphs=False, prefill_pack=1, bf16_gemv_rows=0), max_batch=1,
                   fast=graphed.runner.fast, talker=graphed.talker)
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


def test_packed_prefill_tracks_one_prompt_per_forward(model):
    """6 prompts of different lengths prefilled in one graph replay (PrefillGraphs.run_many, bf16) vs each
    alone (prefill_pack=1, plain causal attention): every prompt's last-row audio logits within bf16
    rounding (max |d| <= 0.05 nat on logits of spread ~1), the same argmax in >= 95 % of codebooks, and
    the replay equals the same packed body run eagerly (same kernels; 1e-3)."""
    from higgs_stream.engine.cuda_graph import FirstChunk

    packed_eng = engine(model, gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), prefill_pack=8))
    single = engine(model, gpu=ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), prefill_pack=1),
                    fast=packed_eng.runner.fast, talker=packed_eng.talker)
    tok, cfg, _ = model
    rng = np.random.default_rng(3)
    lengths = [7, 40, 19, 64, 3, 90]

    def chunks(eng):
        alloc, out = eng.cache.allocator, []
        for sid, n in enumerate(lengths):
            alloc.reserve(1000 + sid, n)
            out.append(FirstChunk(ids[sid], [eng.runner._kv_slot(alloc.page_table(1000 + sid), q) for q in range(n)]))
        return out

    ids = [rng.integers(0, min(1000, cfg.vocab_size), size=n) for n in lengths]
    with torch.no_grad():
        pg = packed_eng.runner.prefill_graphs
        pc = chunks(packed_eng)
        assert pg.packs(pc) == [[0, 1, 2, 3, 4, 5]]
        logits, _ = (t.clone() for t in pg.run_many(pc))
        pg.enabled = False
        eager, _ = pg.run_many(pc)
        pg.enabled = True
        sc = chunks(single)
        alone = torch.cat([single.runner.prefill_graphs.run_many([c])[0].clone() for c in sc])
    assert (logits - eager).abs().max().item() <= 1e-3  # the same kernels, replayed or not
    d = (logits - alone).abs().max().item()
    agree = (logits.argmax(-1) == alone.argmax(-1)).float().mean().item()
    assert d <= 0.05 and agree >= 0.95, (d, agree)
