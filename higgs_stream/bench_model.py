"""Parity harnesses for GPU benchmarks, on random-weight models (no checkpoint files needed; the
models come from `engine/random_weights.py`: `random_reference`, `talker_from_reference`).

`logprob_parity` compares our fast path (prefill through FlashInfer's paged prefill, then decode
steps replayed from the CUDA graphs) with the reference's full forward on the same tokens: on random
fed-back columns, or on our own greedy columns (then it also measures the greedy-parity length).
`fast_logits` + `compare_logits` compare two of our engines the same way (e.g. quantized vs not, any
family); `end_of_speech_guard` checks how streams end (EOS or the frame cap, never a runaway).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from higgs_stream.engine.fast_talker import FastInputs
from higgs_stream.engine.gpu_sampling import StreamStart
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
from higgs_stream.kernels.attention import PagedLayout
from higgs_stream.kernels.flashinfer_attention import HostCSR, RefAttention


def parity_request(frames: int = 40, seed: int = 0) -> GenerationRequest:
    codes = np.random.default_rng(seed).integers(0, 1024, size=(8, frames))
    return GenerationRequest(
        text="The quick brown fox jumps over the lazy dog while the morning train rolls into the station.",
        reference=Reference(codes, "Good morning! How are you today?"), sampling=SamplingParams(temperature=0.0))


@torch.no_grad()
def logprob_parity(hf: torch.nn.Module, engine: Any, steps: int = 24, topk: int = 64, seed: int = 0,
                   columns: str = "random") -> dict:
    """Audio log-probs of our fast path vs transformers' fp32 v2 reference (`hf`) at the prompt's last
    position and `steps` teacher-forced decode steps (graph replays when the engine has graphs).

    columns "random": fed-back columns drawn at random; "greedy": each fed-back column is our own
    argmax of the step before (raw argmax, no delay-pattern rules), so `greedy_parity_steps` (the
    first position where the reference's argmax column differs from ours) is the number of steps
    both would decode greedily before their first differing column. See `compare_logits` for the rest."""
    prompt = engine.policy.build_prompt(parity_request(seed=seed))
    ours, cols = fast_logits(engine, prompt, steps, None if columns == "greedy" else _random_columns(engine, steps, seed))
    ref = reference_logits(hf, engine, prompt, cols)
    return {"positions": steps + 1, "prompt_len": len(prompt), "columns": columns, **compare_logits(ours, ref, topk)}


def _random_columns(engine: Any, steps: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 1).integers(0, engine.cfg.codebook_size, size=(steps, engine.cfg.num_codebooks))


def compare_logits(ours: torch.Tensor, ref: torch.Tensor, topk: int = 64) -> dict:
    """ours, ref [T, K, V] audio logits at the same T positions. Over the reference's top-k ids of
    every codebook: mean, p99 and max |delta log-prob| (nats); the share of (position, codebook)
    argmaxes that agree; `greedy_parity_steps`: the first position whose argmax column differs (T if
    none: with greedy teacher-forced columns, the steps until the first differing column)."""
    ours, ref = ours.float(), ref.float()
    lp_ref, lp_ours = ref.log_softmax(-1), ours.log_softmax(-1)
    top = lp_ref.topk(topk, dim=-1).indices
    delta = (lp_ours.gather(-1, top) - lp_ref.gather(-1, top)).abs().flatten()
    agree = ours.argmax(-1) == ref.argmax(-1)  # [T, K]
    differ = (~agree.all(dim=1)).nonzero().flatten()
    top2 = ref.topk(2, dim=-1).values  # [T, K, 2]
    margin = (top2[..., 0] - top2[..., 1])  # [T, K]
    first = int(differ[0]) if len(differ) else None
    return {"topk": topk, "mean_abs_delta_nat": delta.mean().item(), "p99_abs_delta_nat": delta.quantile(0.99).item(),
            "max_abs_delta_nat": delta.max().item(), "argmax_agreement": agree.float().mean().item(),
            "greedy_parity_steps": first if first is not None else ours.shape[0],
            "ref_margin_at_first_diff": margin[first][~agree[first]].min().item() if first is not None else None,
            "ref_median_top2_margin": margin.median().item(), "ref_logit_std": ref.std().item()}


@torch.no_grad()
def reference_logits(hf: torch.nn.Module, engine: Any, prompt: Any, columns: np.ndarray) -> torch.Tensor:
    """transformers' v2 reference over prompt + fed-back columns: audio logits [steps + 1, K, V]
    fp32 at the prompt's last position and every fed-back column."""
    cfg, tok, dev = engine.cfg, engine.tokenizer, engine.device
    p, steps = len(prompt), len(columns)
    ids = np.concatenate([prompt.input_ids, np.full(steps, tok.special.audio_out)])
    codes = np.concatenate([prompt.audio_codes, columns.reshape(steps, cfg.num_codebooks)])
    is_audio = np.concatenate([prompt.is_audio, np.ones(steps, bool)])
    hidden = hf.model(input_ids=torch.from_numpy(ids)[None].to(dev),
                      audio_input_ids=torch.from_numpy(codes[is_audio])[None].to(dev),
                      audio_input_ids_mask=torch.ones(1, int(is_audio.sum()), dtype=torch.bool, device=dev),
                      ).last_hidden_state[0]  # [T, H]
    return hf.audio_lm_head(hidden[p - 1:]).float().view(steps + 1, cfg.num_codebooks, cfg.audio_vocab)


@torch.no_grad()
def fast_logits(engine: Any, prompt: Any, steps: int, columns: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """Our fast path's audio logits [steps + 1, K, V] fp32 at the prompt's last position and after each
    of `steps` fed-back columns: the prompt in two prefill chunks (eager), then decode steps (graph
    replays when the engine has graphs, else eager). columns [steps, K], or None: greedy, each column
    the argmax of the logits before it. Returns (logits, the columns fed)."""
    cfg, dev = engine.cfg, engine.device
    p = len(prompt)
    sid, alloc, ps = 10**9, engine.cache.allocator, engine.cache.allocator.page_size
    slot = engine.runner._free_slots[-1]
    got, fed = [], []
    try:
        cut = p // 2
        for start, stop in ((0, cut), (cut, p)):
            alloc.reserve(sid, stop)
            table = alloc.page_table(sid)
            inp = _prefill_inputs(engine, prompt, start, stop, table)
            _plan(engine, [table], [stop], [stop - start])
            logits = engine.runner.fast.forward(inp, engine.runner._attn, engine.cache.pool.k, engine.cache.pool.v)
        got.append(logits[0].float())
        engine.runner.state.start([StreamStart(slot, SamplingParams(temperature=0.0, ras_window=0, seed=0), 10**6,
                                               np.zeros((cfg.num_codebooks, 0), np.int64))])
        for j in range(steps):
            pos = p + j
            alloc.reserve(sid, pos + 1)
            table = alloc.page_table(sid)
            kv_slot = table[pos // ps] * ps + pos % ps
            col = got[-1].argmax(-1) if columns is None else torch.from_numpy(columns[j]).to(dev)  # [K]
            fed.append(col.cpu().numpy())
            if engine.runner.graphs is not None:
                engine.runner.state.last_col[slot] = col
                engine.runner.graphs.run([pos], [kv_slot], [slot], [table], [pos + 1])
                got.append(engine.runner.graphs.last_logits(1)[0].float().clone())
            else:  # eager (kernels="ref" on the CPU: exercises this harness in tests)
                t = lambda a: torch.tensor(a, device=dev)  # noqa: E731
                inp = FastInputs(text_ids=None, codes=col[None], positions=t([pos]), kv_slots=t([kv_slot]),
                                 out_rows=t([0]))
                _plan(engine, [table], [pos + 1], [1])
                got.append(engine.runner.fast.forward(inp, engine.runner._attn, engine.cache.pool.k,
                                                      engine.cache.pool.v)[0].float())
    finally:
        engine.runner.state.release(slot)
        alloc.free(sid)
    cols = np.stack(fed) if fed else np.zeros((0, cfg.num_codebooks), np.int64)
    return torch.stack(got), cols.astype(np.int64)


def _plan(engine: Any, tables: list[list[int]], kv_lens: list[int], qo_lens: list[int]) -> None:
    ps = engine.cache.allocator.page_size
    if isinstance(engine.runner._attn, RefAttention):
        engine.runner._attn.plan_layout(PagedLayout.build(tables, kv_lens, qo_lens, ps, engine.device))
    else:
        engine.runner._attn.plan(HostCSR.build(tables, kv_lens, qo_lens, ps), decode=max(qo_lens) == 1)


def _prefill_inputs(engine: Any, prompt: Any, start: int, stop: int, table: list[int]) -> FastInputs:
    dev, ps = engine.device, engine.cache.allocator.page_size
    audio = prompt.is_audio[start:stop]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    return FastInputs(
        text_ids=t(prompt.input_ids[start:stop]), codes=t(prompt.audio_codes[start:stop]),
        positions=t(np.arange(start, stop)), kv_slots=t(np.array([table[q // ps] * ps + q % ps for q in range(start, stop)])),
        out_rows=t(np.array([stop - start - 1])), audio_rows=t(np.flatnonzero(audio)), text_rows=t(np.flatnonzero(~audio)),
        select=t(audio.astype(np.int32)))


@torch.no_grad()
def batch_vs_single(engine: Any, single: Any, n: int = 6, steps: int = 32, seed: int = 0,
                    batched_prefill: bool = False) -> dict:
    """Teacher-forced audio logits of n streams decoded together (engine: graph replay when it has
    graphs) vs each alone (`single`: eager, batch 1), same weights, same fed-back columns.
    batched_prefill: the engine side prefills all n prompts in one ragged forward (as the engine
    does when they arrive together) instead of one by one.
    Returns max |delta logit| and, for argmax disagreements, the top-2 margin they happened at."""
    cfg, dev = engine.cfg, engine.device
    texts = ["Hello world. " * (1 + 2 * i) for i in range(n)]
    prompts = [engine.policy.build_prompt(GenerationRequest(text=t)) for t in texts]
    rng = np.random.default_rng(seed)
    cont = rng.integers(0, cfg.codebook_size, size=(steps, n, cfg.num_codebooks))
    sids = [10**9 + i for i in range(n)]
    slots = [engine.runner._free_slots[-1 - i] for i in range(n)]
    params = SamplingParams(temperature=0.0, ras_window=0, seed=0)
    engine.runner.state.start([StreamStart(s, params, 10**6, np.zeros((cfg.num_codebooks, 0), np.int64)) for s in slots])
    deltas, flips, margins_at_flips, min_margin = [], 0, [], []
    try:
        for eng in (engine, single):
            if eng is engine and batched_prefill:
                _prefill_many(eng, sids, prompts)
                continue
            for sid, prompt in zip(sids, prompts):
                _prefill(eng, sid, prompt)
        for j in range(steps):
            ps = engine.cache.allocator.page_size
            pos = [len(p) + j for p in prompts]
            tables = []
            for sid, q in zip(sids, pos):
                engine.cache.allocator.reserve(sid, q + 1)
                tables.append(engine.cache.allocator.page_table(sid))
            kv = [t[q // ps] * ps + q % ps for t, q in zip(tables, pos)]
            col = torch.from_numpy(cont[j]).to(dev)
            if engine.runner.graphs is not None:
                engine.runner.state.last_col[torch.tensor(slots, device=dev)] = col
                engine.runner.graphs.run(pos, kv, slots, tables, [q + 1 for q in pos])
                batched = engine.runner.graphs.last_logits(n).float().clone()
            else:
                t = lambda a: torch.tensor(a, device=dev)  # noqa: E731
                _plan(engine, tables, [q + 1 for q in pos], [1] * n)
                inp = FastInputs(text_ids=None, codes=col, positions=t(pos), kv_slots=t(kv), out_rows=t(list(range(n))))
                batched = engine.runner.fast.forward(inp, engine.runner._attn, engine.cache.pool.k, engine.cache.pool.v).float()
            for i, (sid, q) in enumerate(zip(sids, pos)):
                alloc = single.cache.allocator
                alloc.reserve(sid, q + 1)
                table = alloc.page_table(sid)
                t = lambda a: torch.tensor(a, device=dev)  # noqa: E731
                _plan(single, [table], [q + 1], [1])
                inp = FastInputs(text_ids=None, codes=col[i:i + 1], positions=t([q]),
                                 kv_slots=t([table[q // ps] * ps + q % ps]), out_rows=t([0]))
                alone = single.runner.fast.forward(inp, single.runner._attn, single.cache.pool.k, single.cache.pool.v)[0].float()
                deltas.append((alone - batched[i]).abs().max().item())
                top2 = batched[i].topk(2, dim=-1).values  # [K, 2]
                margin = top2[:, 0] - top2[:, 1]
                min_margin.append(margin.min().item())
                disagree = alone.argmax(-1) != batched[i].argmax(-1)
                flips += int(disagree.sum())
                margins_at_flips += margin[disagree].tolist()
    finally:
        for eng in (engine, single):
            for sid in sids:
                if sid in eng.cache.allocator.active_seqs:
                    eng.cache.allocator.free(sid)
        for s in slots:
            engine.runner.state.release(s)
    return {"streams": n, "steps": steps, "batched_prefill": batched_prefill, "max_abs_delta_logit": max(deltas),
            "first_step_max_abs_delta_logit": max(deltas[:n]),
            "mean_max_abs_delta_logit": float(np.mean(deltas)), "argmax_flips": flips,
            "argmax_decisions": n * steps * cfg.num_codebooks,
            "max_margin_at_flip": max(margins_at_flips) if margins_at_flips else None,
            "median_top2_margin": float(np.median(min_margin))}


def _prefill(engine: Any, sid: int, prompt: Any) -> None:
    alloc = engine.cache.allocator
    p = len(prompt)
    alloc.reserve(sid, p)
    table = alloc.page_table(sid)
    _plan(engine, [table], [p], [p])
    engine.runner.fast.hidden(_prefill_inputs(engine, prompt, 0, p, table), engine.runner._attn, engine.cache.pool.k,
                       engine.cache.pool.v)


def _prefill_many(engine: Any, sids: list[int], prompts: list[Any]) -> None:
    """All prompts in one ragged prefill forward (K/V only)."""
    alloc, dev, ps = engine.cache.allocator, engine.device, engine.cache.allocator.page_size
    tables, parts = [], []
    for sid, prompt in zip(sids, prompts):
        alloc.reserve(sid, len(prompt))
        tables.append(alloc.page_table(sid))
    for prompt, table in zip(prompts, tables):
        p = len(prompt)
        parts.append((prompt.input_ids, prompt.audio_codes, prompt.is_audio, np.arange(p),
                      np.array([table[q // ps] * ps + q % ps for q in range(p)])))
    ids, codes, audio, pos, kv = (np.concatenate(x) for x in zip(*parts))
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    inp = FastInputs(text_ids=t(ids), codes=t(codes), positions=t(pos), kv_slots=t(kv), out_rows=t(np.array([0])),
                     audio_rows=t(np.flatnonzero(audio)), text_rows=t(np.flatnonzero(~audio)),
                     select=t(audio.astype(np.int32)))
    _plan(engine, tables, [len(p) for p in prompts], [len(p) for p in prompts])
    engine.runner.fast.hidden(inp, engine.runner._attn, engine.cache.pool.k, engine.cache.pool.v)


def end_of_speech_guard(engine: Any, n: int = 8, max_frames: int = 50, temperature: float = 0.8,
                        seed: int = 0, top_k: int | None = None) -> dict:
    """n sampled streams added at once and stepped until every one ends: each must end by EOS
    ("stop") or at its frame cap ("length", exactly `max_frames` frames), within a step budget
    that a stream decoding past its cap would exceed. Returns how they ended."""
    texts = ["Hello world.", "The quick brown fox jumps over the lazy dog.", "See you tomorrow at nine.",
             "Numbers like one, two and three."]
    reqs = [GenerationRequest(text=texts[i % len(texts)], max_frames=max_frames,
                              sampling=SamplingParams(temperature=temperature, top_k=top_k, seed=seed + i))
            for i in range(n)]
    sids = {engine.add(r): i for i, r in enumerate(reqs)}
    frames, reasons = [0] * n, [None] * n
    budget = 4 * (max_frames + 64) + n  # steps: prefill chunks + frames + delay columns, with room to spare
    steps = 0
    while engine.has_work() and steps < budget:
        for ev in engine.step():
            i = sids[ev.stream_id]
            frames[i] += ev.frame is not None
            if ev.finished:
                reasons[i] = ev.reason
        steps += 1
    for sid, i in sids.items():
        if reasons[i] is None:
            engine.cancel(sid)  # a runaway: stop it, report it
    while engine.has_work():
        engine.step()
    ended = [r for r in reasons if r is not None]
    return {"streams": n, "max_frames": max_frames, "steps": steps,
            "stop": ended.count("stop"), "length": ended.count("length"),
            "other": len(ended) - ended.count("stop") - ended.count("length"), "runaway": reasons.count(None),
            "frames_max": max(frames), "length_at_cap": all(f == max_frames for f, r in zip(frames, reasons)
                                                            if r == "length"),
            "all_ended_by_eos_or_cap": all(r in ("stop", "length") for r in reasons) and max(frames) <= max_frames}
