"""The GPU engine's step logic, run on the CPU with the plain-torch kernels (fp32, tiny checkpoint).

`Engine(kernels="ref", cuda_graphs=False)` runs exactly the code the GPU path runs (fused
weights, device-resident stream state, sample-and-advance, one-step-lagged collection) except
the kernels and the graph replay. Greedy codes must equal the CPU engine's `Engine`, frame for
frame, with RAS, ramps and the frame cap active; sampled codes must depend only on the request
and its seed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import CancelledStream, CapacityError, ConfigError, InvalidInputError
from higgs_stream.engine.fast_talker import FastTalker, KernelUnavailable
from higgs_stream.engine.model_runner import LAG_SLACK, ModelRunnerConfig
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams

REF = ModelRunnerConfig(kernels="ref", cuda_graphs=False)


def engines(ckpt, **config) -> tuple[Engine, Engine]:
    """(the reference runner's engine, the model runner's) over the same weights."""
    cfg = EngineConfig(**{"kv_pages": 256, "max_batch": 8, **config})
    cpu = Engine.from_pretrained(str(ckpt), config=cfg)
    other = Engine.from_pretrained(str(ckpt), config=cfg)
    gpu = Engine(other.talker, other.cfg, other.tokenizer, other.cache, cfg, REF)
    return cpu, gpu


def codes(t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(8, t))


# Greedy + RAS is not deterministic (RAS candidates are random draws from each engine's own
# generator), so the engine-level comparison runs greedy with RAS off; the RAS logic itself is
# compared with SegmentState in tests/engine/models/higgs_v2/test_device_rules.py.
GREEDY = [
    GenerationRequest(text="Hello world.", sampling=SamplingParams(temperature=0.0, ras_window=0), max_frames=30),
    GenerationRequest(text="The quick brown fox jumps over the lazy dog.",
                      reference=Reference(codes(12, 0), "Good morning! How are you today?"),
                      sampling=SamplingParams(temperature=0.0, ras_window=0), max_frames=25),
    GenerationRequest(text="Numbers like 1, 2, 3.", sampling=SamplingParams(temperature=0.0, ras_window=0),
                      max_frames=12),
    GenerationRequest(text="See you tomorrow at nine.", history=(("Hello again, world.", codes(6, 1)),), scene="",
                      sampling=SamplingParams(temperature=0.0, ras_window=0), max_frames=35),
]


def test_fused_talker_logits_equal_talker(tiny_ckpt):
    """FastTalker (fused q/k/v and gate/up, fp32 residual, ref kernels) == Talker.forward on a mixed step."""
    from higgs_stream.engine.batch import StepBatch
    from higgs_stream.engine.fast_talker import FastInputs
    from higgs_stream.engine.kv_cache import KVCache
    from higgs_stream.kernels.flashinfer_attention import RefAttention

    base = Engine.from_pretrained(str(tiny_ckpt))
    talker, cfg = base.talker, base.cfg
    gen = torch.Generator().manual_seed(0)
    n = 11
    is_audio = torch.tensor([False] * 4 + [True] * 7)
    ids = torch.randint(0, 200, (n,), generator=gen)
    codes_ = torch.randint(0, 1026, (n, 8), generator=gen)
    cache_a = KVCache.create(cfg, num_pages=16, page_size=4)
    cache_b = KVCache.create(cfg, num_pages=16, page_size=4)
    for c in (cache_a, cache_b):
        c.allocator.reserve(0, 6)
        c.allocator.reserve(1, 5)
    batch = StepBatch(seq_ids=[0, 1], qo_lens=[6, 5], input_ids=ids, audio_codes=codes_, is_audio=is_audio,
                      positions=torch.cat([torch.arange(6), torch.arange(5)]), want_text=torch.zeros(2, dtype=torch.bool),
                      want_audio=torch.ones(2, dtype=torch.bool))
    ref = talker.forward(batch, cache_a).audio_logits
    fast = FastTalker(talker, "ref")
    layout = cache_b.layout([0, 1], [6, 5])
    attn = RefAttention(cfg.head_dim)
    attn.plan_layout(layout)
    inp = FastInputs(text_ids=ids, codes=codes_, positions=batch.positions, kv_slots=layout.slot_mapping,
                     out_rows=layout.last_token_index, audio_rows=is_audio.nonzero().flatten(),
                     text_rows=(~is_audio).nonzero().flatten(), select=is_audio.int())
    with torch.no_grad():
        got = fast.forward(inp, attn, cache_b.pool.k, cache_b.pool.v)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache_b.pool.k, cache_a.pool.k, rtol=1e-6, atol=1e-6)
    assert set(talker.state_dict()) == set(base.talker.state_dict())  # re-packing kept every key


def test_greedy_codes_equal_cpu_engine(tiny_ckpt, run_staggered):
    """Four greedy streams (frame caps, a reference, history) admitted at different steps."""
    cpu, gpu = engines(tiny_ckpt, token_budget=24)
    want, want_reasons = run_staggered(cpu, GREEDY, [0, 0, 3, 7])
    got, got_reasons = run_staggered(gpu, GREEDY, [0, 0, 3, 7])
    assert got_reasons == want_reasons
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.array_equal(g, w)
    assert any(r == "length" for r in want_reasons)  # the cap path is exercised
    assert sum(g.shape[1] for g in got) > 60


def test_sampled_codes_depend_only_on_seed(tiny_ckpt, run_staggered):
    req = GenerationRequest(text="Hello world.", sampling=SamplingParams(seed=5, temperature=1.0, top_k=40, top_p=0.9),
                            max_frames=20)
    other = GenerationRequest(text="Something else entirely.", sampling=SamplingParams(seed=9), max_frames=30)
    _, gpu = engines(tiny_ckpt)
    alone = gpu.generate(req)
    (together, _), _ = run_staggered(gpu, [req, other], [2, 0])
    assert np.array_equal(alone, together)
    again = GenerationRequest(text="Hello world.", sampling=SamplingParams(seed=6, temperature=1.0, top_k=40, top_p=0.9),
                              max_frames=20)
    other_codes = gpu.generate(again)
    assert not np.array_equal(other_codes, alone[:, : other_codes.shape[1]])
    assert alone.max() < 1024 and alone.shape[1] <= 20


def test_cancel_frees_pages_and_slot(tiny_ckpt):
    _, gpu = engines(tiny_ckpt)
    free_pages = gpu.cache.allocator.num_free
    req = GenerationRequest(text="Hello world.", sampling=SamplingParams(seed=1), max_frames=50)
    it = gpu.stream(req)
    for _ in range(5):
        next(it)
    it.close()
    while gpu.has_work():
        gpu.step()
    assert gpu.cache.allocator.num_free == free_pages
    assert len(gpu.runner._free_slots) == gpu.config.max_batch
    with pytest.raises(CancelledStream):
        gen = gpu.stream(req)
        gpu.cancel(gpu._pending[-1].sid)  # cancelled before its first step
        list(gen)


def test_config_and_input_errors(tiny_ckpt):
    with pytest.raises(ConfigError):
        ModelRunnerConfig(kernels="ref", cuda_graphs=True)
    with pytest.raises(ConfigError, match="tensor_core_decode_from"):
        ModelRunnerConfig(tensor_core_decode_from=0)
    with pytest.raises(ConfigError, match="triton_decode_from"):
        ModelRunnerConfig(triton_decode_from=0)
    for bad in (-1, 5):  # the CUDA-core GEMV serves 1-4 rows
        with pytest.raises(ConfigError, match="cuda_core_gemv_rows"):
            ModelRunnerConfig(cuda_core_gemv_rows=bad)
        with pytest.raises(ConfigError, match="bf16_gemv_rows"):
            ModelRunnerConfig(bf16_gemv_rows=bad)
    assert ModelRunnerConfig().bf16_gemv_rows == 4 and ModelRunnerConfig(bf16_gemv_rows=0).bf16_gemv_rows == 0
    assert ModelRunnerConfig().cuda_core_gemv_rows == 2 and ModelRunnerConfig(cuda_core_gemv_rows=4).cuda_core_gemv_rows == 4
    assert ModelRunnerConfig(tensor_core_decode_from=None).tensor_core_decode_from is None
    with pytest.raises(ConfigError, match="pdl_max_rows"):
        ModelRunnerConfig(pdl_max_rows=-1)
    assert ModelRunnerConfig().pdl_max_rows is None  # the talker's default, below
    base = Engine.from_pretrained(str(tiny_ckpt))
    with pytest.raises(KernelUnavailable, match="CUDA"):
        Engine(base.talker, base.cfg, base.tokenizer, base.cache, None, ModelRunnerConfig(kernels="fast", cuda_graphs=False))
    _, gpu = engines(tiny_ckpt)
    with pytest.raises(InvalidInputError, match="ras_window"):
        gpu.add(GenerationRequest(text="Hi.", sampling=SamplingParams(ras_window=40)))


def test_programmatic_dependent_launch_defaults_follow_the_measurements():
    """default_pdl_max_rows (H200, session 23): bf16 Higgs talkers' decode graphs up to 32 rows, quantized ones up to
    2 (their 16-row graph was slower with it), never for Qwen3-TTS (its frame step did not gain)."""
    from higgs_stream.engine.model_runner import default_pdl_max_rows
    from higgs_stream.engine.models.registry import family_named

    v2, v3, qwen = (family_named(a) for a in ("v2", "v3", "qwen3-tts"))
    assert [default_pdl_max_rows(f, False) for f in (v2, v3, qwen)] == [32, 32, 0]
    assert [default_pdl_max_rows(f, True) for f in (v2, v3, qwen)] == [2, 2, 0]


def test_add_and_admission_commit_the_same_kv_pages(tiny_ckpt):
    """add() counts the one-step lag slack admission reserves: a request that fills the cache to
    the last position is served; one position more is refused by add(), not lost inside step()."""
    cfg = EngineConfig(kv_pages=9, page_size=16, max_batch=2)
    base = Engine.from_pretrained(str(tiny_ckpt), config=cfg)
    gpu = Engine(base.talker, base.cfg, base.tokenizer, base.cache, cfg, REF)
    text, greedy = "Hello world.", SamplingParams(temperature=0.0, ras_window=0)
    prompt_len = len(gpu.policy.build_prompt(GenerationRequest(text)))
    room = gpu.scheduler.config.num_pages * 16  # 8 pages: the 9th is the graph rows' scratch page
    fits = room - prompt_len - gpu.cfg.num_codebooks - LAG_SLACK  # max_frames that fill it exactly
    assert fits > 20
    with pytest.raises(CapacityError, match="KV pages"):
        gpu.add(GenerationRequest(text, sampling=greedy, max_frames=fits + 1))
    assert not gpu.has_work()
    frames = gpu.generate(GenerationRequest(text, sampling=greedy, max_frames=fits))
    assert frames.shape[1] >= 1 and gpu.cache.allocator.num_used == 1  # only the scratch page is held


def test_refused_admission_ends_the_stream_with_an_error_event(tiny_ckpt, monkeypatch):
    """Should the scheduler refuse a stream add() accepted, the stream ends (reason "error"), and
    step() carries on with the others."""
    _, gpu = engines(tiny_ckpt)
    ok = gpu.add(GenerationRequest("Hello world.", sampling=SamplingParams(seed=1), max_frames=5))
    refused = gpu.add(GenerationRequest("Hi there.", sampling=SamplingParams(seed=2), max_frames=5))
    add = gpu.scheduler.add

    def flaky(seq):
        if seq.sid == refused:
            raise CapacityError("no room")
        add(seq)

    monkeypatch.setattr(gpu.scheduler, "add", flaky)
    ends = {}
    while gpu.has_work():
        ends.update({ev.stream_id: ev for ev in gpu.step() if ev.finished})
    assert ends[refused].reason == "error" and "busy" in ends[refused].error
    assert ends[ok].reason in ("stop", "length")
    assert gpu.cache.allocator.num_used == 1


def test_logprob_parity_harness_fp32_cpu():
    """The benchmark's parity harness on a tiny model, fp32 plain-torch path vs transformers: ~1e-6 nat."""
    from higgs_stream.engine.kv_cache import KVCache
    from higgs_stream.engine.models.higgs_v2.random_weights import (
        random_reference,
        talker_from_reference,
        tokenizer_and_config,
    )

    from higgs_stream.bench_model import logprob_parity

    tok, cfg = tokenizer_and_config("tiny")
    hf = random_reference(cfg, "cpu", std=0.1)
    talker = talker_from_reference(hf, cfg, torch.float32)
    cache = KVCache.create(cfg, 64, 16)
    eng = Engine(talker, cfg, tok, cache, EngineConfig(max_batch=2, kv_pages=64), REF)
    res = logprob_parity(hf, eng, steps=4)
    assert res["mean_abs_delta_nat"] < 1e-5 and res["argmax_agreement"] == 1.0, res
    assert res["ref_logit_std"] > 0.3  # logits far from uniform: the comparison means something
    assert eng.cache.allocator.num_free == 63 and len(eng.runner._free_slots) == 2  # harness cleaned up


def test_load_engine_picks_the_reference_runner_on_cpu(tiny_ckpt):
    from higgs_stream.engine.engine import load_engine
    from higgs_stream.engine.ref_runner import RefRunner

    eng = load_engine(str(tiny_ckpt), device="cpu", cuda_graphs=False)
    assert type(eng) is Engine and type(eng.runner) is RefRunner and eng.talker.dtype == torch.float32


def sampled_beside_another(ckpt) -> tuple[Engine, int, np.ndarray]:
    """The model runner's engine with a sampled stream `a` and a second one added (not yet stepped), and
    a's codes generated alone first."""
    req = GenerationRequest(text="Hello world.", sampling=SamplingParams(seed=5, temperature=1.0, top_k=40, top_p=0.9),
                            max_frames=40)
    other = GenerationRequest(text="Something else entirely.", sampling=SamplingParams(seed=9), max_frames=40)
    _, gpu = engines(ckpt)
    alone = gpu.generate(req)
    a = gpu.add(req)
    gpu.add(other)  # a second stream shares the steps
    return gpu, a, alone


def test_paused_stream_resumes_with_the_same_codes(tiny_ckpt):
    """The GPU path's pipelined step (launch k+1, then collect k) with a stream left out of some
    steps: its sampled codes equal those of a run without pauses."""
    gpu, a, alone = sampled_beside_another(tiny_ckpt)
    cols: list[np.ndarray] = []
    for step in range(400):
        if step == 10:
            gpu.pause(a)
        if step == 25:
            gpu.resume(a)
        cols += [ev.frame for ev in gpu.step() if ev.stream_id == a and ev.frame is not None]
        if not gpu.has_work() and not gpu.scheduler.num_paused:
            break
    assert np.array_equal(np.stack(cols, axis=1), alone)
    assert gpu.num_active == 0


def test_synchronous_steps_give_the_same_codes_and_leave_nothing_in_flight(tiny_ckpt):
    """Engine.step(sync=True) mixed with pipelined steps (the server's relaxed mode): with a step in flight it
    only collects it (nothing launched), else it returns its own step's rows; a stream's sampled codes are
    those of a run of pipelined steps alone."""
    gpu, a, alone = sampled_beside_another(tiny_ckpt)
    launches: list[int] = []
    launch = gpu.runner._launch
    gpu.runner._launch = lambda plan: (launches.append(len(plan)), launch(plan))[1]
    cols: list[np.ndarray] = []
    drains = 0
    for step in range(400):
        sync = (step // 7) % 2 == 1  # runs of pipelined and synchronous steps
        busy, before = gpu.runner.busy, len(launches)
        events = gpu.step(sync=sync)
        if sync:
            assert not gpu.runner.busy  # nothing left queued
            if busy:  # a step was in flight: collected, nothing launched
                assert len(launches) == before
                drains += 1
        cols += [ev.frame for ev in events if ev.stream_id == a and ev.frame is not None]
        if not gpu.has_work():
            break
    assert drains >= 1
    assert np.array_equal(np.stack(cols, axis=1), alone)
    assert gpu.num_active == 0


@pytest.mark.parametrize("fast", [False, True])
def test_frame_n_arrives_with_the_step_of_delay_column_n_plus_8(tiny_ckpt, fast):
    """The engine emits frames at the steps it emitted the delay-pattern columns that complete them:
    frame n with column n + 8 (column 0, the AUDIO_INIT one, at the prompt's step), on both runners
    (the ModelRunner folds AUDIO_INIT into the prompt's step and collects a step late: the same
    step). So an exact first chunk's 11 frames are there at step 18, the 19th column's, as before."""
    cfg = EngineConfig(kv_pages=128, max_batch=4, token_budget=512)  # the prompt runs in step 0
    base = Engine.from_pretrained(str(tiny_ckpt), config=cfg)
    engine = Engine(base.talker, base.cfg, base.tokenizer, base.cache, cfg, REF if fast else None)
    sid = engine.add(GenerationRequest("Hello world.", sampling=SamplingParams(seed=1), max_frames=30))
    steps, step = [], 0
    while engine.has_work():
        steps += [step for ev in engine.step() if ev.stream_id == sid and ev.frame is not None]
        step += 1
    assert len(steps) >= 11 and steps[:11] == list(range(8, 19))
    assert steps == list(range(8, 8 + len(steps)))  # then one frame per step


@pytest.mark.parametrize("arch", ["v3", "qwen3-tts"])
def test_packed_prompts_keep_plan_order_beside_eager_chunks(arch, monkeypatch):
    """The runner's prefill with PrefillGraphs (eager body, CPU, fp32): three prompts admitted in one step,
    the middle one too long for the graphs' buckets (run eagerly, one chunk per forward), the other two
    packed into one run: the prompt-end logits handed to sampling are, in plan order, each prompt's own
    (the same runner with one prompt per run, within 1e-5); families that sample at the prompt end."""
    from higgs_stream.engine.cuda_graph import PrefillGraphs
    from higgs_stream.engine.random_weights import in_memory_engine

    texts = ["Hi.", "Hello there, how are you doing today? " * 3, "Ok."]

    def first_step(pack: int):
        eng = in_memory_engine(arch, "tiny", "cpu", torch.float32, EngineConfig(kv_pages=128, max_batch=4),
                               cuda_graphs=False, kernels="ref")
        r = eng.runner
        r.prefill_graphs = PrefillGraphs(r.fast, eng.cache.pool.k, eng.cache.pool.v, r.scratch_page,
                                         eng.cache.allocator.page_size, buckets=(8, 32), enabled=False,
                                         max_prompts=pack)
        lengths = [eng.policy.build_prompt(GenerationRequest(text=t)).input_ids.shape[0] for t in texts]
        assert lengths[0] <= 32 < lengths[1] and lengths[2] <= 32, lengths
        seen, sample = [], r.state.sample_and_advance

        def spy(logits, *rest):
            seen.append(logits.clone())
            return sample(logits, *rest)

        monkeypatch.setattr(r.state, "sample_and_advance", spy)
        packs = []
        run_many = r.prefill_graphs.run_many
        monkeypatch.setattr(r.prefill_graphs, "run_many", lambda chunks: packs.append(len(chunks)) or run_many(chunks))
        for t in texts:
            eng.add(GenerationRequest(text=t, max_frames=4, sampling=SamplingParams(temperature=0.0)))
        eng.step()
        assert r.last_prefill == 3
        return seen[0], packs

    packed, packs = first_step(4)
    alone, runs = first_step(1)
    assert packs == [2] and runs == [1, 1]  # prompts 0 and 2 in one run; prompt 1 eagerly in both
    assert packed.shape[0] == 3
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert (packed[0] - packed[1]).abs().max() > 1e-3 and (packed[1] - packed[2]).abs().max() > 1e-3


def test_fused_fp8_quantization_is_for_the_fast_kernels_only(tiny_ckpt):
    """fuse_fp8_quant asks the fast kernels' fused norm and SiLU; the plain-torch kernels have none, so a reference
    runner ignores it (the fused path's values: tests/kernels/test_fp8_rows.py, and on the GPU
    tests/engine/test_quantize_gpu.py)."""
    base = Engine.from_pretrained(str(tiny_ckpt))
    ref = Engine(base.talker, base.cfg, base.tokenizer, base.cache, None,
                 ModelRunnerConfig(kernels="ref", cuda_graphs=False, fuse_fp8_quant=True))
    assert ref.runner.fast.fuse_fp8 is False and ref.runner.fast.k.add_rms_norm_fp8 is None
    plain = FastTalker(base.talker, "ref", max_positions=4096)
    assert plain.fuse_fp8 is False


def test_cuda_core_gemv_is_for_the_fast_kernels_only(tiny_ckpt):
    """cuda_core_gemv_rows picks a fast-path kernel (kernels/int8_linear.py triton_gemv); a reference runner ignores
    it, and on the CPU the quantized linear (ATen's int8 kernel) is the same with or without it (its GPU test:
    tests/engine/test_quantize_gpu.py)."""
    from higgs_stream.engine import quantize

    base = Engine.from_pretrained(str(tiny_ckpt))
    ref = Engine(base.talker, base.cfg, base.tokenizer, base.cache, None,
                 ModelRunnerConfig(kernels="ref", cuda_graphs=False, cuda_core_gemv_rows=4))
    assert ref.runner.fast.cuda_core_gemv_rows == 0
    w = quantize.quantize_weight(torch.randn(24, 32, generator=torch.Generator().manual_seed(0)), "int8")
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(quantize.linear(x, w, "fast", cuda_core_rows=4), quantize.linear(x, w, "fast"))  # CPU: ATen's


def test_the_runner_config_of_an_fp8_talker_replays_the_16_row_graph_for_3_to_16_rows():
    """runner_config (serve, synth, random:full): fp8 weights skip the 4, 8 and 12-row decode graphs (H200: a 4-row
    step 2.82 ms on its own graph, 2.58 on the 16-row one); other modes keep every bucket; options win."""
    from higgs_stream.engine.cuda_graph import DEFAULT_BUCKETS
    from higgs_stream.engine.model_runner import runner_config

    fp8 = runner_config("fp8").graph_buckets
    assert fp8[:3] == (1, 2, 16) and set(fp8) == set(DEFAULT_BUCKETS) - {4, 8, 12}
    assert runner_config("none").graph_buckets == runner_config("int8").graph_buckets == DEFAULT_BUCKETS
    own = runner_config("fp8", options={"graph_buckets": (1, 4), "prefill_pack": 2})
    assert own.graph_buckets == (1, 4) and own.prefill_pack == 2
    ref = runner_config("none", cuda_graphs=True, kernels="ref")
    assert ref.kernels == "ref" and not ref.cuda_graphs
