"""The fast path's step logic for Qwen3-TTS on the CPU: `ModelRunner(kernels="ref", cuda_graphs=False)`
in fp32 over the fixture checkpoint runs the GPU path's code (FastTalker with QK-norm and the
family's row embedding, the device-resident group-0 rules, the code predictor's 15 sub-steps with
every group sampled on the device (the predictor on FastTalker's stack: fast_predictor.py), eager
prompt chunks, one-step-lagged collection) except the kernels and the graph replay.

Greedy frames must equal the plain-torch RefRunner's, frame for frame, for several streams of each
variant (CustomVoice with text in the prompt or streamed, VoiceDesign, Base with reference codes),
of different prompt lengths, joining and leaving mid-run, with chunked prompts, frame caps and EOS
stops. Sampled frames cannot equal the RefRunner's: it draws from a `torch.Generator` per stream
(engine/sampling.py), the device from counter-based noise keyed on (seed, column) (gpu_sampling.py),
as for the Higgs families; so sampled frames are checked to depend on the request and its seed only.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.fast_talker import FastTalker
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.models.qwen3_tts.checkpoint import load_model
from higgs_stream.engine.models.qwen3_tts.device_rules import QwenDeviceRules
from higgs_stream.engine.models.qwen3_tts.fast_predictor import FastCodePredictor
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams

REF = ModelRunnerConfig(kernels="ref", cuda_graphs=False)
GREEDY = SamplingParams(temperature=0.0)





def engine(model, tokenizer, variant: str, runner: ModelRunnerConfig | None, **config) -> Engine:
    cfg = replace(model.cfg, variant=variant)
    econf = EngineConfig(**{"kv_pages": 160, "max_batch": 4, "token_budget": 24, **config})  # prompts: several chunks
    cache = KVCache.create(cfg, num_pages=econf.kv_pages, page_size=16, dtype=torch.float32)
    return Engine(model, cfg, tokenizer, cache, econf, runner)


def pair(model, tokenizer, variant: str, **config) -> tuple[Engine, Engine]:
    """(the RefRunner's engine, the ModelRunner's) over the same weights."""
    return engine(model, tokenizer, variant, None, **config), engine(model, tokenizer, variant, REF, **config)


def greedy(text: str, max_frames: int, **kw) -> GenerationRequest:
    return GenerationRequest(text, sampling=GREEDY, max_frames=max_frames, **kw)


def stop_on(model, code: int) -> None:
    """Make group 0 emit EOS wherever it would emit `code` (EOS's head row := 1.05 x that code's row)."""
    w = model.talker.codec_head.weight  # [vocab, H]
    with torch.no_grad():
        w[model.cfg.codec_eos_id] = 1.05 * w[code]


def check_equal(ref_engine, fast_engine, requests, admit_at, run_staggered) -> list[str]:
    want, want_reasons = run_staggered(ref_engine, requests, admit_at)
    got, got_reasons = run_staggered(fast_engine, requests, admit_at)
    assert got_reasons == want_reasons
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        diff = np.nonzero((g != w).any(axis=0))[0]
        assert diff.size == 0, f"stream {i} differs from frame {diff[0] if diff.size else None}"
    assert fast_engine.cache.allocator.num_used == 1  # every stream's pages freed; the graph rows' scratch page
    assert len(fast_engine.runner._free_slots) == fast_engine.config.max_batch
    return want_reasons


def test_the_model_runner_packs_the_qwen_talker(model, tokenizer):
    ref, fast = pair(model, tokenizer, "custom_voice")
    assert isinstance(fast.runner.fast, FastTalker) and fast.runner.fast.layers[0].qk_norm is not None
    assert fast.runner.fast.embed_rows is not None and fast.runner.prefill_graphs is None
    assert isinstance(fast.runner.state.rules, QwenDeviceRules)
    assert isinstance(fast.runner.state.complete, FastCodePredictor)  # the code predictor on the fast stack
    assert fast.runner.state.v == model.cfg.vocab_size
    # one GEMV choice per FastTalker, the code predictor's too; on the plain-torch kernels nothing is timed
    choices = fast.runner.gemv_choices()
    assert set(choices) == {"talker", "code_predictor"}
    assert choices["code_predictor"] is fast.runner.state.complete.fast.gemv
    assert all(c.max_rows == 0 and not c.shapes for c in choices.values())
    assert ref.runner.gemv_choices() == {}  # the RefRunner: plain torch


@pytest.mark.parametrize("admit_at", [[0, 0, 4, 9], [0, 2, 2, 30]])
def test_custom_voice_greedy_frames_equal_the_ref_runner(model, tokenizer, admit_at, run_staggered):
    """Four CustomVoice streams (text in the prompt or streamed one id per step, other speakers and
    languages, prompts of different lengths): the long one runs 110 frames while others join and
    end by their frame caps."""
    requests = [
        greedy("A", 110, speaker="aiden", language="english", stream_text=True),
        greedy("B", 23, speaker="dylan", language="chinese", stream_text=True),
        greedy("A", 40),  # text in the prompt (the CustomVoice default), the default speaker
        greedy("B", 12, speaker="aiden", stream_text=False),
    ]
    reasons = check_equal(*pair(model, tokenizer, "custom_voice"), requests, admit_at, run_staggered)
    assert reasons.count("length") >= 3


def test_voice_design_and_base_greedy_frames_equal_the_ref_runner(model, tokenizer, ref, run_staggered):
    design = [greedy("B", 100, instructions="I"), greedy("A", 30, instructions="I"), greedy("A", 17)]
    check_equal(*pair(model, tokenizer, "voice_design"), design, [0, 3, 3], run_staggered)
    spk = ref["clone_spk"]
    clone = [
        greedy("A", 60, reference=Reference(ref["clone_ref_codes"].T, "R", embedding=spk), language="english"),
        greedy("B", 25, reference=Reference(ref["clone_ref_codes"].T[:, :5], "R", embedding=spk)),
        greedy("A", 20, reference=Reference(ref["clone_ref_codes"].T, "R", embedding=-spk), stream_text=False),
    ]
    check_equal(*pair(model, tokenizer, "base"), clone, [0, 1, 8], run_staggered)


def test_eos_stops_equal_the_ref_runner(tiny_dir, tokenizer, run_staggered):
    """With EOS made the argmax wherever group 0 would emit a frequent code, streams stop (no frame
    for the EOS row) at the same frame on both runners; EOS is held off for the first 2 frames."""
    model = load_model(tiny_dir)
    ref_engine, _ = pair(model, tokenizer, "custom_voice")
    frames = ref_engine.generate(greedy("A", 60, speaker="aiden", stream_text=True))  # [16, F]
    values, counts = np.unique(frames[0, 2:], return_counts=True)
    stop_on(model, int(values[counts.argmax()]))
    requests = [greedy("A", 60, speaker="aiden", stream_text=True), greedy("B", 60, speaker="dylan"),
                greedy("A", 5, speaker="aiden")]
    reasons = check_equal(*pair(model, tokenizer, "custom_voice"), requests, [0, 1, 3], run_staggered)
    assert "stop" in reasons


def test_sampled_frames_depend_only_on_the_request_and_seed(model, tokenizer, run_staggered):
    req = GenerationRequest("A", speaker="aiden", stream_text=True, max_frames=30,
                            sampling=SamplingParams(seed=5, temperature=0.9, top_k=50, top_p=0.95))
    other = GenerationRequest("B", speaker="dylan", max_frames=40, sampling=SamplingParams(seed=9))
    fast = engine(model, tokenizer, "custom_voice", REF)
    alone = fast.generate(req)
    (together, _), _ = run_staggered(fast, [req, other], [3, 0])
    assert np.array_equal(alone, together)
    again = fast.generate(replace(req, sampling=replace(req.sampling, seed=6)))
    n = min(again.shape[1], alone.shape[1])
    assert not np.array_equal(again[:, :n], alone[:, :n])
    assert alone.max() < model.cfg.codebook_size and alone.shape[1] <= 30
    assert fast.cache.allocator.num_used == 1


def test_sampled_frames_hold_codes_under_staggered_arrivals(model, tokenizer):
    """The server's sampling (temperature 0.7, top-p 0.95) for 16 streams arriving two per step through
    4 batch slots (chunked prompts beside decode rows, slots reused): every frame holds codes (the
    tiny vocabulary is 94 % special ids: a rule that let one through would show), every stream ends
    by EOS or its cap. The GPU twin: test_sampled_frames_gpu.py."""
    fast = engine(model, tokenizer, "custom_voice", REF)
    pending, reasons, frames = list(range(16)), [], 0
    while pending or fast.has_work():
        for i in pending[:2]:
            fast.add(GenerationRequest("AB"[i % 2], max_frames=20 + i,
                                       sampling=SamplingParams(temperature=0.7, top_p=0.95, seed=i)))
        del pending[:2]
        for ev in fast.step():
            if ev.frame is not None:
                frames += 1
                assert np.asarray(ev.frame).max() < model.cfg.codebook_size, ev
            if ev.finished:
                reasons.append(ev.reason)
    assert len(reasons) == 16 and set(reasons) <= {"stop", "length"} and frames > 100


def test_cancel_frees_pages_and_slot(model, tokenizer):
    fast = engine(model, tokenizer, "custom_voice", REF)
    free = fast.cache.allocator.num_free
    it = fast.stream(GenerationRequest("A", sampling=SamplingParams(seed=1), max_frames=50))
    for _ in range(4):
        next(it)
    it.close()
    while fast.has_work():
        fast.step()
    assert fast.cache.allocator.num_free == free and len(fast.runner._free_slots) == fast.config.max_batch


def test_from_pretrained_builds_the_model_runner(tmp_path):
    """The path `load_engine` takes on CUDA (here with the plain-torch kernels on the CPU): a hub-layout
    checkpoint (make-checkpoint --arch qwen3-tts) with its text tokenizer, the ModelRunner, frames of
    real codes."""
    from higgs_stream.engine.checkpoint_writer import write_checkpoint
    from higgs_stream.engine.model_runner import ModelRunner

    root = write_checkpoint(tmp_path / "q", arch="qwen3-tts", preset="tiny", seed=3)
    eng = Engine.from_pretrained(str(root), config=EngineConfig(kv_pages=64, max_batch=2), runner=REF)
    assert isinstance(eng.runner, ModelRunner)
    frames = eng.generate(GenerationRequest("Hello there.", max_frames=12,
                                            sampling=SamplingParams(temperature=0.0)))  # [16, F]
    assert frames.shape[0] == 16 and 1 <= frames.shape[1] <= 12 and frames.max() < eng.cfg.codebook_size
