"""Sampled Qwen3-TTS frames on the CUDA fast path hold codes only (CUDA only; full-size 0.6B random
weights, bf16). A served checkpoint under 20 req/s on an H100 ended one stream in ~70 with a group-0
id of the special range (2197, `QwenFrameWriter`'s "non-code id"), never at 1 req/s; greedy parity
tests never sample. This drives the server's sampling (temperature 0.7, top-p 0.95) for many
streams arriving a few per step (prompts in chunks beside decode rows, batch buckets padded, slots
reused), eager and graphed, and asserts every frame is codes and every stream ends by EOS or the cap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.models.qwen3_tts.random_weights import random_talker
from higgs_stream.engine.request import GenerationRequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def talker():
    return random_talker("full", "cuda", torch.bfloat16, max_positions=4096, seed=0)


@pytest.mark.parametrize("graphs", [False, True])
def test_sampled_frames_hold_codes_under_staggered_arrivals(talker, graphs):
    model, cfg, tok = talker
    config = EngineConfig(max_batch=64, token_budget=256, kv_pages=3000, max_seq_len=2048)
    cache = KVCache.create(cfg, num_pages=config.kv_pages, page_size=16, dtype=torch.bfloat16, device="cuda")
    eng = Engine(model, cfg, tok, cache, config, ModelRunnerConfig(cuda_graphs=graphs))
    texts = [("Hello there, this is stream %d. " % i) * (1 + i % 5) for i in range(96)]
    pending, bad, reasons, frames = list(range(len(texts))), [], {}, 0
    while pending or eng.has_work():
        for _ in range(min(4, len(pending))):
            i = pending.pop(0)
            eng.add(GenerationRequest(texts[i], max_frames=60,
                                      sampling=SamplingParams(temperature=0.7, top_p=0.95, seed=i)))
        for ev in eng.step():
            if ev.frame is not None:
                frames += 1
                if (np.asarray(ev.frame) >= cfg.codebook_size).any():
                    bad.append((ev.stream_id, np.asarray(ev.frame).tolist()))
            if ev.finished:
                reasons[ev.reason] = reasons.get(ev.reason, 0) + 1
                if ev.reason == "error":
                    bad.append((ev.stream_id, ev.error))
    print(f"graphs={graphs}: {frames} frames, reasons {reasons}, bad {bad[:3]}")
    assert not bad and sum(reasons.values()) == len(texts) and set(reasons) <= {"stop", "length"}
