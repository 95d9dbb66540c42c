"""Qwen3-TTS on the fast path on CUDA, a small random model (head_dim 64, GQA group 4: FlashInfer's;
the code predictor head_dim 64), bf16:

- the fast kernels (Triton + FlashInfer) track the plain-torch `*_ref` kernels on the same weights:
  group 0's logits of a prompt's last position and of a decode row (teacher-forced), and the code
  predictor on FastTalker's stack tracks the plain `CodePredictor.run` (groups 1..15, teacher-forced);
  bounds stated;
- one graph replay of the whole frame step (talker, 15 code-predictor sub-steps, the sampling of
  all 16 groups, the rules) == the same body run eagerly on the same staged inputs and state
  (logits max |delta| <= 1e-4, rows and state identical), and graphed engines == eager engines;
- greedy frames of streams served together (graphs, bucket 8) == each stream served alone (eager,
  batch 1), and sampled frames depend on the request and its seed only.

Run: `pytest -q tests/engine/models/qwen3_tts/test_model_runner_gpu.py -m gpu`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.fast_talker import FastInputs, FastTalker
from higgs_stream.engine.gpu_sampling import StreamStart
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.models.qwen3_tts.config import CodePredictorConfig, preset
from higgs_stream.engine.models.qwen3_tts.random_weights import random_model, text_tokenizer
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
from higgs_stream.kernels.attention import PagedLayout
from higgs_stream.kernels.flashinfer_attention import FlashInferAttention, HostCSR, RefAttention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = replace(preset("tiny"), hidden_size=512, intermediate_size=1024, num_layers=3, num_heads=8, num_kv_heads=2,
              head_dim=64, text_hidden_size=256,
              code_predictor=CodePredictorConfig(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                                                 num_kv_heads=2, head_dim=64, rope_theta=10000.0))
TEXTS = ["Hello there.", "How are you today? " * 2, "Numbers: 1, 2, 3.", "Good morning to you all. " * 3,
         "Hi.", "See you tomorrow at nine, said the man at the station. " * 2]


@pytest.fixture(scope="module")
def model():
    """EOS's head row zeroed: its logit 0 is never the argmax of 64 zero-mean code logits, so greedy
    streams run to their frame caps (sampled ones may still draw it)."""
    talker = random_model(CFG, "cuda", torch.bfloat16, seed=1)
    with torch.no_grad():
        talker.talker.codec_head.weight[CFG.codec_eos_id] = 0
    return talker, text_tokenizer(CFG)


def engine(model, runner=None, max_batch=8, fast=None):
    talker, tok = model
    cache = KVCache.create(CFG, num_pages=300, page_size=16, dtype=torch.bfloat16, device="cuda")
    return Engine(talker, CFG, tok, cache, EngineConfig(max_batch=max_batch, kv_pages=300, max_seq_len=1024),
                  runner or ModelRunnerConfig(graph_buckets=(1, 2, 4, 8)), fast=fast)


def run(eng, requests):
    """Every request's frames [F, 16], all added at once."""
    sids = {eng.add(r): i for i, r in enumerate(requests)}
    frames = {i: [] for i in range(len(requests))}
    while eng.has_work():
        for ev in eng.step():
            if ev.frame is not None:
                frames[sids[ev.stream_id]].append(ev.frame)
    return [np.stack(frames[i]) if frames[i] else np.zeros((0, 16), np.int64) for i in range(len(requests))]


def greedy(text: str, frames: int, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(text, speaker="aiden", stream_text=True, max_frames=frames,
                             sampling=SamplingParams(temperature=0.0, seed=seed))


# ---------------------------------------------------------------------- fast vs ref kernels
def _step_logits(model, kernels: str, prompt, frame: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group 0's logits [V] at a prompt's last position (one eager chunk) and at one decode row feeding
    `frame` [16] with the next text id, through FastTalker with `kernels`."""
    talker, _ = model
    fast = FastTalker(talker, kernels, max_positions=1024)
    cache = KVCache.create(CFG, num_pages=16, page_size=16, dtype=torch.bfloat16, device="cuda")
    ps, p = 16, len(prompt)
    cache.allocator.reserve(0, p + 1)
    table = cache.allocator.page_table(0)
    slots = [table[q // ps] * ps + q % ps for q in range(p + 1)]
    if kernels == "ref":
        attn = RefAttention(CFG.head_dim)
        plan = lambda kv, qo: attn.plan_layout(PagedLayout.build([table], [kv], [qo], ps, "cuda"))
    else:
        attn = FlashInferAttention(CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, ps, torch.device("cuda"),
                                   torch.bfloat16, kv_dtype=torch.bfloat16)
        plan = lambda kv, qo: attn.plan(HostCSR.build([table], [kv], [qo], ps), decode=qo == 1)
    t = lambda a: torch.as_tensor(np.asarray(a)).cuda()
    audio = prompt.is_audio
    inp = FastInputs(text_ids=t(prompt.input_ids), codes=t(prompt.audio_codes), positions=t(np.arange(p)),
                     kv_slots=t(slots[:p]), out_rows=t([p - 1]), audio_rows=t(np.flatnonzero(audio)),
                     text_rows=t(np.flatnonzero(~audio)), select=t(audio.astype(np.int32)),
                     codec_ids=t(prompt.codec_ids))
    with torch.no_grad():
        plan(p, p)
        first = fast.audio_logits(fast.hidden(inp, attn, cache.pool.k, cache.pool.v))[0, 0]
        plan(p + 1, 1)
        dec = FastInputs(text_ids=t([prompt.step_text_id(0)]), codes=frame[None].cuda(), positions=t([p]),
                         kv_slots=t(slots[p:]), out_rows=t([0]))
        second = fast.audio_logits(fast.hidden(dec, attn, cache.pool.k, cache.pool.v))[0, 0]
    return first, second


def test_fast_kernels_track_the_ref_kernels(model):
    """bf16 both ways (Triton + FlashInfer vs the plain-torch `*_ref` kernels), six prompts, the prompt's
    last position and one decode row each: max |delta logit| <= 10% of the logits' std, the argmax
    equal in >= 10 of the 12."""
    eng = engine(model, ModelRunnerConfig(kernels="ref", cuda_graphs=False))
    rels, agree = [], 0
    for i, text in enumerate(TEXTS):
        prompt = eng.policy.build_prompt(greedy(text, 10))
        frame = torch.randint(0, CFG.codebook_size, (16,), generator=torch.Generator().manual_seed(i))
        for a, b in zip(_step_logits(model, "fast", prompt, frame), _step_logits(model, "ref", prompt, frame)):
            rels.append(float((a - b).abs().max() / b.std()))
            agree += int(a.argmax()) == int(b.argmax())
    print(f"fast vs ref kernels: max |delta logit| = {max(rels):.4f} x std, argmax equal {agree}/12")
    assert max(rels) <= 0.10 and agree >= 10, (rels, agree)


def _predictor_vs_plain(talker, predictor, rows: int = 8) -> tuple[float, float]:
    """Groups 1..15's logits of `predictor` (a FastCodePredictor), teacher-forced with the same ids, vs the plain-torch
    `CodePredictor.run`, bf16, `rows` rows: (max |delta logit| / std, share of equal argmaxes)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, CFG.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    head = torch.randint(0, CFG.codebook_size, (rows, 1), generator=gen, device="cuda")
    forced = torch.randint(0, CFG.codebook_size, (rows, 16), generator=gen, device="cuda")

    def logits_of(run) -> list[torch.Tensor]:
        seen = []

        def pick(g: int, lg: torch.Tensor) -> torch.Tensor:
            seen.append(lg.clone())
            return forced[:, g]

        with torch.no_grad():
            run(pick)
        return seen

    want = logits_of(lambda pick: talker.talker.code_predictor.run(hidden, head[:, 0], talker.codec_embed(head[:, 0]),
                                                                   pick))
    got = logits_of(lambda pick: predictor(hidden, head, pick))
    assert len(got) == len(want) == 15
    agree = np.mean([float((a.argmax(-1) == b.argmax(-1)).float().mean()) for a, b in zip(got, want)])
    return max(float((a - b).abs().max() / b.std()) for a, b in zip(got, want)), float(agree)


def test_fast_code_predictor_tracks_the_plain_one(model):
    """Groups 1..15's logits, teacher-forced with the same ids: the predictor on FastTalker's stack with
    the fast kernels and with the `*_ref` kernels vs the plain-torch `CodePredictor.run` (the
    RefRunner's), bf16, 8 rows: max |delta logit| <= 10% of the logits' std, argmax equal on >= 90%."""
    from higgs_stream.engine.models.qwen3_tts.fast_predictor import FastCodePredictor

    talker, _ = model
    for kernels in ("fast", "ref"):
        rel, agree = _predictor_vs_plain(talker, FastCodePredictor(talker, kernels))
        print(f"code predictor ({kernels} kernels) vs plain: max |delta logit| = {rel:.4f} x std, argmax agree {agree:.3f}")
        assert rel <= 0.10 and agree >= 0.90, (kernels, rel, agree)


# ---------------------------------------------------------------------- graph replay vs eager
def _snapshot(state) -> dict:
    """Every tensor of the device state and its rules (to run one step twice from the same state)."""
    tensors = {("state", k): v.clone() for k, v in vars(state).items() if isinstance(v, torch.Tensor)}
    tensors.update({("rules", k): v.clone() for k, v in vars(state.rules).items() if isinstance(v, torch.Tensor)})
    return tensors


def _restore(state, snap: dict) -> None:
    for (owner, k), v in snap.items():
        getattr(state if owner == "state" else state.rules, k).copy_(v)


def test_one_replay_equals_the_eager_body(model):
    """The same staged step (5 streams in bucket 8, 300 positions of context each, sampled and greedy
    rows) replayed from the graph and run eagerly from the same state: logits max |delta| <= 1e-4,
    the packed rows and every state tensor equal."""
    eng = engine(model)
    g, state, alloc = eng.runner.graphs, eng.runner.state, eng.cache.allocator
    n, context, ps = 5, 300, 16
    slots = [eng.runner._free_slots[-1 - i] for i in range(n)]
    params = [SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=0.9, top_k=50, seed=2),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_p=0.9, seed=4),
              SamplingParams(temperature=0.0, seed=5)]
    state.start([StreamStart(s, p, 10**6, np.zeros((16, 0), np.int64)) for s, p in zip(slots, params)])
    sids = [10**9 + i for i in range(n)]
    for sid in sids:
        alloc.reserve(sid, context)
    tables = [alloc.page_table(s) for s in sids]
    with torch.no_grad():
        for step in range(4):  # a few steps: the rules' state (frames, seen ids) moves
            pos = context - 4 + step
            args = ([pos] * n, [t[pos // ps] * ps + pos % ps for t in tables], slots, tables, [pos + 1] * n,
                    [CFG.tts_pad_id] * n)
            b = g.stage(*args)
            snap = _snapshot(state)
            packed = g.replay(b, n).clone()
            logits = g.last_logits(n).clone()
            after = _snapshot(state)
            _restore(state, snap)
            packed_e, logits_e = (x[:n].clone() for x in g._body(b))
            delta = float((logits - logits_e).abs().max())
            assert delta <= 1e-4, f"step {step}: graph vs eager logits max |delta| = {delta}"
            assert torch.equal(packed, packed_e), f"step {step}"
            for key, v in _snapshot(state).items():
                assert torch.equal(v, after[key]), f"step {step}: {key} differs"
    print(f"graph replay vs eager body: logits max |delta| = {delta}")


def test_graphed_engine_equals_eager_engine(model):
    """4 streams (= a bucket: the eager step multiplies the same rows), greedy then sampled: graphed ==
    eager, frame for frame."""
    graphed = engine(model)
    eager = engine(model, ModelRunnerConfig(cuda_graphs=False), fast=graphed.runner.fast)
    greedy_reqs = [greedy(t, 60, seed=i) for i, t in enumerate(TEXTS[:4])]
    for x, y in zip(run(graphed, greedy_reqs), run(eager, greedy_reqs)):
        assert x.shape == (60, 16) and np.array_equal(x, y)
    sampled = [GenerationRequest(TEXTS[0], speaker="aiden", max_frames=40,
                                 sampling=SamplingParams(seed=3, temperature=0.9, top_k=50))] * 4
    # identical prompts packed into one prefill may round differently at different rows: one per forward
    one = engine(model, ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), prefill_pack=1), fast=graphed.runner.fast)
    s = run(one, sampled)
    assert all(np.array_equal(s[0], x) for x in s[1:])  # same request + seed, same frames
    one_eager = engine(model, ModelRunnerConfig(cuda_graphs=False, prefill_pack=1), fast=graphed.runner.fast)
    assert np.array_equal(s[0], run(one_eager, sampled)[0])


def test_base_prompts_replay_their_prefill_and_first_frame_from_graphs(model):
    """A Base prompt's first chunk carries reference frames and a speaker vector (x-vector): the graphed
    engine replays it from a prefill graph and its first frame from a prompt-end graph; 4 streams (a
    bucket), greedy: frames equal the eager engine's (the same padded bodies, run eagerly)."""
    cfg = replace(CFG, variant="base")
    talker = random_model(cfg, "cuda", torch.bfloat16, seed=2)
    with torch.no_grad():
        talker.talker.codec_head.weight[cfg.codec_eos_id] = 0
    tok = text_tokenizer(cfg)
    rng = np.random.default_rng(0)

    def make(runner=None, fast=None):
        cache = KVCache.create(cfg, num_pages=300, page_size=16, dtype=torch.bfloat16, device="cuda")
        return Engine(talker, cfg, tok, cache, EngineConfig(max_batch=8, kv_pages=300, max_seq_len=1024),
                      runner or ModelRunnerConfig(graph_buckets=(1, 2, 4, 8)), fast=fast)

    graphed = make()
    assert graphed.runner.prefill_graphs is not None and graphed.runner.prefill_graphs.embeds
    eager = make(ModelRunnerConfig(cuda_graphs=False), fast=graphed.runner.fast)
    requests = [GenerationRequest(t, reference=Reference(rng.integers(0, cfg.codebook_size, (16, 3 + 4 * i)), "R",
                                                         embedding=rng.standard_normal(cfg.hidden_size).astype(np.float32)),
                                  max_frames=40, sampling=SamplingParams(temperature=0.0, seed=i))
                for i, t in enumerate(TEXTS[:4])]
    for x, y in zip(run(graphed, requests), run(eager, requests)):
        assert x.shape == (40, 16) and np.array_equal(x, y)


def test_batched_greedy_frames_equal_each_stream_alone(model):
    """6 streams of different prompt lengths admitted together (graphs, bucket 8), up to 100 greedy
    frames each: every stream's frames equal the eager batch-1 engine's (`prefill_pack=1`: prompts
    prefilled one per forward, the batch-invariant prefill). `bf16_gemv_rows=0`: the linears on cuBLAS at every row
    count (the GEMV engine/gemv_choice.py may pick for 1-4 rows: test_gemv_choice_keeps_a_stream_alone_equal_to_
    pairs)."""
    graphed = engine(model, ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), prefill_pack=1, bf16_gemv_rows=0))
    alone = engine(model, ModelRunnerConfig(cuda_graphs=False, prefill_pack=1, bf16_gemv_rows=0), max_batch=1,
                   fast=graphed.runner.fast)
    requests = [greedy(t, 100, seed=20 + i) for i, t in enumerate(TEXTS)]
    together = run(graphed, requests)
    for i, r in enumerate(requests):
        want = run(alone, [r])[0]
        assert together[i].shape == want.shape == (100, 16), (i, together[i].shape, want.shape)
        diff = np.nonzero((together[i] != want).any(axis=1))[0]
        assert diff.size == 0, f"stream {i} differs from frame {diff[0]}"


def test_gemv_choice_keeps_a_stream_alone_equal_to_pairs(model, monkeypatch):
    """Every plain linear of the talker and the code predictor forced onto the CUDA-core GEMV at 1-4 rows
    (engine/gemv_choice.py's margin set so that it wins everywhere): the predictor's logits still track the
    plain-torch one (two rows: the sub-steps' 4 and 2 rows on the GEMV), within
    test_fast_code_predictor_tracks_the_plain_one's bound; and 4 streams in graphed pairs (bucket 2: the
    predictor's sub-steps of 4 and 2 rows) give each stream the frames of the eager batch-1 engine (2 and 1 rows),
    for 60 greedy frames."""
    from higgs_stream.engine import gemv_choice
    from higgs_stream.engine.models.qwen3_tts.fast_predictor import FastCodePredictor

    monkeypatch.setattr(gemv_choice, "MARGIN", 1e9)
    talker, _ = model
    one = FastCodePredictor(talker, "fast", bf16_gemv_rows=4)
    assert len(one.fast.gemv.shapes) == 4  # q/k/v, o, gate/up, down (the input projection: the down's shape)
    rel, agree = _predictor_vs_plain(talker, one, rows=2)  # sub-steps of 4 and 2 rows: the GEMV's
    print(f"code predictor (GEMV) vs plain: max |delta logit| = {rel:.4f} x std, argmax agree {agree:.3f}")
    assert rel <= 0.10 and agree >= 0.90, (rel, agree)
    pairs = engine(model, ModelRunnerConfig(graph_buckets=(1, 2), prefill_pack=1), max_batch=2)
    assert len(pairs.runner.fast.gemv.shapes) == 4 and len(pairs.runner.fast.complete_rows.fast.gemv.shapes) == 4
    alone = engine(model, ModelRunnerConfig(cuda_graphs=False, prefill_pack=1), max_batch=1, fast=pairs.runner.fast)
    requests = [greedy(t, 60, seed=40 + i) for i, t in enumerate(TEXTS[:4])]
    for i in (0, 2):
        together = run(pairs, requests[i:i + 2])
        for j in (0, 1):
            want = run(alone, [requests[i + j]])[0]
            assert together[j].shape == want.shape == (60, 16)
            diff = np.nonzero((together[j] != want).any(axis=1))[0]
            assert diff.size == 0, f"stream {i + j} differs from frame {diff[0]}"


# ---------------------------------------------------------------------- late prompts
def test_late_prompts_on_cuda_give_the_frames_of_classic_steps(model):
    """Prompts added while the host waits for a graphed step (EngineConfig.late_prompts: prefilled in a
    launch of their own behind the step just launched, polled on real CUDA events) give the greedy frames
    of the same prompts admitted at the next step; one prompt per prefill replay (prefill_pack 1) so a
    stream's K/V do not depend on what shares its launch. Every page and slot comes back. `bf16_gemv_rows=0`: the
    linears on cuBLAS at every row count (the two ways batch the streams' steps differently, and the GEMV that
    engine/gemv_choice.py may pick for 1-4 rows sums in another order than cuBLAS at 5-8)."""
    arrivals = {0: [0], 3: [1, 2], 5: [3], 9: [4, 5]}
    requests = [greedy(t, 12 + 5 * i) for i, t in enumerate(TEXTS)]

    def drive(late: bool):
        talker, tok = model
        cache = KVCache.create(CFG, num_pages=300, page_size=16, dtype=torch.bfloat16, device="cuda")
        eng = Engine(talker, CFG, tok, cache, EngineConfig(max_batch=8, kv_pages=300, max_seq_len=1024,
                                                           late_prompts=late, late_prompts_in_bursts=True),
                     ModelRunnerConfig(graph_buckets=(1, 2, 4, 8), prefill_pack=1, bf16_gemv_rows=0))
        run_, sids, frames, calls = eng.runner.run, {}, {}, [0]

        def hooked(plan, **kw):  # the event loop adds prompts while the engine thread is in the runner
            for i in arrivals.get(calls[0], []):
                sids[eng.add(requests[i])] = i
            return run_(plan, **kw)

        eng.runner.run = hooked
        while calls[0] < 10 or eng.has_work():
            for ev in eng.step():
                if ev.frame is not None:
                    frames.setdefault(sids[ev.stream_id], []).append(ev.frame)
            calls[0] += 1
        assert eng.cache.allocator.num_used == 1 and len(eng.runner._free_slots) == 8
        return {i: np.stack(f) for i, f in frames.items()}, eng.runner.late_launches

    classic, none = drive(False)
    late, launches = drive(True)
    assert none == 0 and launches >= 2
    assert sorted(late) == sorted(classic) == list(range(len(requests)))
    for i in classic:
        assert np.array_equal(late[i], classic[i]), f"stream {i}"
