"""The GPU engine's step logic on a tiny v3 checkpoint, run on the CPU (plain-torch kernels, fp32).

`GpuEngine(kernels="ref", cuda_graphs=False)` over a `TalkerV3` runs the GPU path's code (fused
weights with QK-norm, device-resident v3 row rules, row 0 sampled at the prompt's end inside a
ragged prefill, one-step-lagged collection, the rows' writer) except the kernels and the graph
replay. Greedy codec frames must equal the CPU `Engine`'s, frame for frame, with chunked prompts,
references, history, frame caps and EOC stops.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.fast_talker import FastTalker
from higgs_stream.engine.gpu_engine import GpuEngine, GpuEngineConfig
from higgs_stream.engine.models.higgs_v3.config import TalkerV3Config
from higgs_stream.engine.models.higgs_v3.device_rules import V3DeviceRules
from higgs_stream.engine.models.higgs_v3.talker import TalkerV3
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams

REF = GpuEngineConfig(kernels="ref", cuda_graphs=False)
K, BOC, EOC = 8, 1024, 1025
CONFIG = EngineConfig(kv_pages=256, max_batch=8, token_budget=24)  # prompts take several chunks


def codes(t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(K, t))


def greedy(text: str, max_frames: int, **kw) -> GenerationRequest:
    return GenerationRequest(text=text, sampling=SamplingParams(temperature=0.0, seed=0), max_frames=max_frames, **kw)


REQUESTS = [
    greedy("Hello world.", 30),
    greedy("The quick brown fox jumps over the lazy dog.", 25,
           reference=Reference(codes(12, 0), "Good morning! How are you today?")),
    greedy("Numbers like 1, 2, 3.", 12),
    greedy("See you tomorrow at nine.", 35, history=(Reference(codes(6, 1), "Hello again, world."),)),
]


def stop_on(engine: Engine, code: int) -> None:
    """Make codebook 0 emit EOC wherever it would emit `code` (the tied EOC row := 1.05 x that code's row)."""
    w = engine.talker.audio.embedding.weight  # [K * 1026, H], codebook 0 first
    with torch.no_grad():
        w[EOC] = 1.05 * w[code]


@pytest.fixture(scope="module")
def stop_code(tiny_v3_ckpt) -> int:
    """A code that codebook 0 emits after the ramp-up in the first request (random weights never stop)."""
    frames = Engine.from_pretrained(str(tiny_v3_ckpt), config=CONFIG).generate(REQUESTS[0])
    return int(frames[0, 12])  # row 12 (frame f's codebook 0 is row f's)


def test_from_pretrained_dispatches_to_v3(tiny_v3_ckpt):
    eng = GpuEngine.from_pretrained(str(tiny_v3_ckpt), device="cpu", dtype=torch.float32, config=CONFIG, gpu=REF)
    assert isinstance(eng.talker, TalkerV3) and isinstance(eng.cfg, TalkerV3Config)
    assert isinstance(eng.fast, FastTalker) and eng.fast.layers[0].qk_norm is not None
    assert isinstance(eng.state.rules, V3DeviceRules) and eng.fast.max_positions > CONFIG.max_seq_len
    assert eng.cache.pool.k.dtype == torch.float32


@pytest.mark.parametrize("admit_at", [[0, 0, 3, 7], [0, 1, 1, 2]])
def test_greedy_frames_equal_cpu_engine(tiny_v3_ckpt, stop_code, admit_at, run_staggered):
    cpu = Engine.from_pretrained(str(tiny_v3_ckpt), config=CONFIG)
    other = Engine.from_pretrained(str(tiny_v3_ckpt), config=CONFIG)
    for e in (cpu, other):
        stop_on(e, stop_code)
    gpu = GpuEngine(other.talker, other.cfg, other.tokenizer, other.cache, CONFIG, REF)
    want, want_reasons = run_staggered(cpu, REQUESTS, admit_at)
    got, got_reasons = run_staggered(gpu, REQUESTS, admit_at)
    assert got_reasons == want_reasons
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.array_equal(g, w)
    assert "stop" in want_reasons and "length" in want_reasons  # both endings exercised
    for g in got:  # codec frames: real codes only (the writer replaced stray BOC/EOC)
        assert g.shape[0] == K and g.max() < BOC
    assert gpu.cache.allocator.num_free == CONFIG.kv_pages - 1 and len(gpu._free_slots) == CONFIG.max_batch  # - scratch
