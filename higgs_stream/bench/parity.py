"""The parity section's own check: greedy codes of the graphed batched engine against the eager batch-1
engine (the log-prob parity against transformers' reference is bench_model.logprob_parity)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from higgs_stream.bench.model import TEXT
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.models.higgs_v2.prompt import build_prompt
from higgs_stream.engine.request import GenerationRequest, SamplingParams


def eager_batch1(engine: Engine, talker: Any, cfg: Any, tok: Any) -> Engine:
    """A batch-1 engine without graphs beside `engine`, sharing its fast path (weights), on its own
    small K/V pool."""
    small = KVCache.create(cfg, num_pages=600, page_size=16, dtype=torch.bfloat16, device="cuda")
    return Engine(talker, cfg, tok, small, EngineConfig(max_batch=1, kv_pages=600, max_seq_len=4096),
                  ModelRunnerConfig(cuda_graphs=False), fast=engine.runner.fast)


def greedy_batch_parity(engine: Engine, eager: Engine, n: int = 6, steps: int = 200, ras_window: int = 0) -> dict:
    """Greedy codes of n concurrent streams (different prompt lengths, same seeds) through the graphed
    batched engine vs each stream alone through the eager batch-1 engine."""
    texts = [TEXT[: 20 + 37 * i] for i in range(n)]
    reqs = [GenerationRequest(text=t, sampling=SamplingParams(temperature=0.0, seed=100 + i, ras_window=ras_window),
                              max_frames=steps) for i, t in enumerate(texts)]
    alone = [eager.generate(r) for r in reqs]
    sids = {engine.add(r): i for i, r in enumerate(reqs)}
    frames: dict[int, list] = {i: [] for i in range(n)}
    open_ = set(sids)
    while open_ or engine.has_work():
        for ev in engine.step():
            if ev.frame is not None:
                frames[sids[ev.stream_id]].append(ev.frame)
            if ev.finished:
                open_.discard(ev.stream_id)
    rows = []
    for i in range(n):
        got, want = np.stack(frames[i], axis=1) if frames[i] else np.zeros((8, 0), np.int64), alone[i]
        m = min(got.shape[1], want.shape[1])
        diff = np.nonzero((got[:, :m] != want[:, :m]).any(axis=0))[0]
        rows.append({"prompt_len": len(build_prompt(engine.tokenizer, reqs[i], 8, 1024)), "frames": int(got.shape[1]),
                     "frames_alone": int(want.shape[1]), "equal": bool(got.shape == want.shape and not len(diff)),
                     "first_diff_frame": int(diff[0]) if len(diff) else None})
    return {"ras_window": ras_window, "streams": rows, "all_equal": all(r["equal"] for r in rows)}
