"""The decode step: graph-replay time vs batch size beside the weight-read floor (from a copy bandwidth
measured in the run), its kernels (torch.profiler), and transformers' `generate` as the baseline."""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch

from higgs_stream.bench.measure import device_seconds, log
from higgs_stream.bench.model import TEXT
from higgs_stream.engine.engine import Engine
from higgs_stream.engine.gpu_sampling import StreamStart
from higgs_stream.engine.models.higgs_v2.prompt import build_prompt
from higgs_stream.engine.request import GenerationRequest, SamplingParams


def copy_bandwidth(gib: float = 2.0, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written per second)."""
    n = int(gib * (1 << 30)) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = device_seconds(partial(dst.copy_, src), reps)
    del src, dst
    return 2 * n * 4 / seconds


def record_floor(engine: Engine, result: dict, bw: float) -> int:
    """The weight bytes an audio step reads and the batch-1 floor they set at copy bandwidth `bw`
    (`copy_bandwidth`), into `result`; returns the bytes."""
    weight_bytes = engine.runner.fast.audio_step_bytes()
    result["audio_step_weight_bytes"] = weight_bytes
    result["floor_batch1_ms"] = weight_bytes / bw * 1e3
    return weight_bytes


@torch.inference_mode()
def decode_sweep(engine: Engine, batches: list[int], context: int, weight_bytes: int, bw: float, reps: int = 30) -> list[dict]:
    """Decode step time at each batch size: graph replay alone (device time) and the full host+device
    step (staging, FlashInfer plan, replay), each stream holding `context` tokens of random K/V."""
    cfg, alloc, ps = engine.cfg, engine.cache.allocator, engine.cache.allocator.page_size
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.cache.pool.k.element_size()
    out = []
    for b in batches:
        sids = [2**40 + i for i in range(b)]
        slots = [engine.runner._free_slots[-1 - i] for i in range(b)]
        for sid in sids:
            alloc.reserve(sid, context)
        engine.runner.state.start([StreamStart(s, SamplingParams(temperature=0.7, seed=s), 10**6,
                                               np.zeros((cfg.num_codebooks, 0), np.int64)) for s in slots])
        tables = [alloc.page_table(s) for s in sids]
        pos = context - 1
        args = ([pos] * b, [t[pos // ps] * ps + pos % ps for t in tables], slots, tables, [context] * b)
        for _ in range(3):
            engine.runner.graphs.run(*args)
        torch.cuda.synchronize()
        graph = engine.runner.graphs._graphs[engine.runner.graphs.bucket_for(b)]
        replay = device_seconds(graph.replay, reps)
        t0 = time.perf_counter()
        for _ in range(reps):
            engine.runner.graphs.run(*args)
        torch.cuda.synchronize()
        full = (time.perf_counter() - t0) / reps
        for sid in sids:
            alloc.free(sid)
        for s in slots:
            engine.runner.state.release(s)
        floor_w = weight_bytes / bw
        floor_kv = (weight_bytes + b * context * kv_token_bytes) / bw
        out.append({"batch": b, "bucket": engine.runner.graphs.bucket_for(b), "context": context, "replay_ms": replay * 1e3,
                    "step_ms": full * 1e3, "floor_weights_ms": floor_w * 1e3, "floor_weights_kv_ms": floor_kv * 1e3,
                    "replay_over_floor": replay / floor_kv, "frames_per_s": b / full})
        log(f"decode b={b}: replay {replay*1e3:.3f} ms, step {full*1e3:.3f} ms, floor {floor_kv*1e3:.3f} ms")
    return out


@torch.inference_mode()
def transformers_baseline(hf: torch.nn.Module, engine: Engine, steps: int = 48) -> dict:
    """transformers' generate at batch 1 (the reference in bf16, greedy): frames per second."""
    req = GenerationRequest(text=TEXT, sampling=SamplingParams(temperature=0.0))
    prompt = build_prompt(engine.tokenizer, req, 8, 1024)
    ids = torch.from_numpy(prompt.input_ids)[None].cuda()
    hf.generate(input_ids=ids, max_new_tokens=4, do_sample=False)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, max_new_tokens=steps, do_sample=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    seq = out if isinstance(out, torch.Tensor) else out.sequences
    made = int(seq.shape[1]) if seq.dim() == 3 else int(seq.shape[-1] - ids.shape[1])
    return {"method": "HiggsAudioV2ForConditionalGeneration.generate (bf16, greedy, batch 1)", "steps": made,
            "wall_s": wall, "ms_per_step": wall / max(made, 1) * 1e3, "frames_per_s": made / wall}


@torch.inference_mode()
def profile_decode(engine: Engine, batch: int, context: int = 300, top: int = 12) -> dict:
    """GPU time per kernel of one eager decode step (the graph's body), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    alloc, ps, g = engine.cache.allocator, engine.cache.allocator.page_size, engine.runner.graphs
    sids = [2**41 + i for i in range(batch)]
    slots = [engine.runner._free_slots[-1 - i] for i in range(batch)]
    for sid in sids:
        alloc.reserve(sid, context)
    tables = [alloc.page_table(s) for s in sids]
    pos = context - 1
    b = g.bucket_for(batch)
    g._stage(b, [pos] * batch, [t[pos // ps] * ps + pos % ps for t in tables], slots, tables, [context] * batch)
    for _ in range(2):
        g._body(b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g._body(b)
        torch.cuda.synchronize()
    for sid in sids:
        alloc.free(sid)
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.count:
            rows.append((t, ev.count, ev.key))
    kernels = [r for r in rows if not r[2].startswith(("cudaLaunch", "Memcpy", "Memset", "cuda"))]
    total = sum(t for t, _, _ in kernels)
    kernels.sort(reverse=True)
    groups: dict[str, list[float]] = {}
    for t, c, k in kernels:
        g_ = groups.setdefault(kernel_group(k), [0.0, 0])
        g_[0] += t
        g_[1] += c
    return {"batch": batch, "bucket": b, "kernel_us_total": total, "kernels": sum(c for _, c, _ in kernels),
            "groups": {k: {"us": v[0], "count": v[1]} for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])},
            "top": [{"us": t, "count": c, "name": k[:90]} for t, c, k in kernels[:top]]}


KERNEL_GROUPS = (  # (group, substrings of a kernel's name, lower case), first match wins
    ("attention", ("flashinfer", "batchdecode", "batchprefill", "attention", "flash_fwd", "sdpa", "paged_decode")),
    ("rope/kv store", ("rope", "kv_store", "append_paged")),
    ("norm", ("norm",)),
    ("act quant", ("quantize_per_token",)),
    ("gemm", ("gemm", "gemv", "cutlass", "sm90_", "sm80_", "cublas", "matmul", "_mm_", "linear", "nvjet", "xmma")),
    ("sampling", ("sample", "draw", "topk", "top_k", "softmax", "argmax", "gumbel", "noise", "philox")),
    ("activation", ("silu", "gelu", "act_and_mul", "swiglu")),
)


def kernel_group(name: str) -> str:
    """The group of a CUDA kernel by its name (KERNEL_GROUPS), "other" when none matches."""
    low = name.lower()
    return next((g for g, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")


def decode_profiles(engine: Engine, batches: tuple[int, ...] = (1, 64), context: int = 300) -> list[dict]:
    """profile_decode at each batch size, each logged with its top kernels."""
    out = [profile_decode(engine, b, context) for b in batches]
    for p in out:
        log(f"profile b={p['batch']}: {p['kernels']} kernels, {p['kernel_us_total']:.0f} us; top: "
            + "; ".join(f"{k['us']:.0f}us x{k['count']} {k['name'][:40]}" for k in p["top"][:8]))
        log(f"profile b={p['batch']} by group: "
            + "; ".join(f"{g} {v['us']:.0f}us x{v['count']}" for g, v in p["groups"].items()))
    return out
