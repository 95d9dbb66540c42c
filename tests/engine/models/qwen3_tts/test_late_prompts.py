"""Late prompts (`EngineConfig.late_prompts`, engine/model_runner.py) on the CPU: the fast path's step
logic with the plain-torch kernels over the tiny Qwen3-TTS checkpoint (a family that samples at the prompt
end), prompts arriving *while* a step runs (added from inside the runner's launch, as the event loop adds
them while the engine thread waits for the device).

A prompt that arrives so is prefilled, and its first row sampled and completed, in a launch of its own
right behind the step just launched; greedy frames are those of the same prompt admitted at the next step
(the classic path), for streams that join, leave by their caps and run chunked prompts; at most two launches
stay in flight, pages and slots all come back, and a failing late launch fails only its own streams.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.launch_queue import LATE_PER_STEP
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.request import GenerationRequest, SamplingParams

REF = ModelRunnerConfig(kernels="ref", cuda_graphs=False)
GREEDY = SamplingParams(temperature=0.0)
REQUESTS = [  # prompts of 1 to 3 chunks (token_budget 24: chunks of 19), caps ending streams mid-run
    GenerationRequest("A", speaker="aiden", language="english", stream_text=True, sampling=GREEDY, max_frames=40),
    GenerationRequest("B", speaker="dylan", sampling=GREEDY, max_frames=9),
    GenerationRequest("A", sampling=GREEDY, max_frames=25),
    GenerationRequest("B", speaker="aiden", stream_text=False, sampling=GREEDY, max_frames=14),
    GenerationRequest("A", speaker="dylan", language="chinese", sampling=GREEDY, max_frames=18),
]


def make(model, tokenizer, late: bool, in_bursts: bool = True) -> Engine:
    cfg = replace(model.cfg, variant="custom_voice")
    econf = EngineConfig(kv_pages=160, max_batch=4, token_budget=24, late_prompts=late, late_prompts_in_bursts=in_bursts)
    return Engine(model, cfg, tokenizer, KVCache.create(cfg, num_pages=160, page_size=16, dtype=torch.float32),
                  econf, REF)


def drive(engine: Engine, arrive_during: dict[int, list[int]], sync_every: int = 0,
          arrive_after_late: dict[int, list[int]] | None = None) -> tuple[dict[int, np.ndarray], dict[int, str], list]:
    """Step until every request ended; the requests REQUESTS[i] for i in `arrive_during[s]` are added during
    step call s, after its plan was made (as the runner starts); those in `arrive_after_late[n]` right after the
    n-th late launch (0-based) was made, while the host still waits. Returns frames [K, F] and end reasons by
    request index, and a log of ('step' | 'late', call index, launched sequence ids) in launch order, with
    ('add', call index, sequence id, whether more streams than batch slots were active then) at each arrival.
    `sync_every` n > 0: runs of n pipelined and n synchronous calls (the server's relaxed mode)."""
    runner, calls, log = engine.runner, [0], []
    run, launch, launch_prompts = runner.run, runner._launch, runner.queue._launch_prompts  # the queue's late launches
    sids: dict[int, int] = {}
    after_late = dict(arrive_after_late or {})

    def add(i: int) -> None:
        sid = engine.add(REQUESTS[i])
        sids[sid] = i
        log.append(("add", calls[0], sid, engine.num_active > engine.config.max_batch))

    def hooked_run(plan, **kw):
        for i in arrive_during.get(calls[0], []):
            add(i)
        return run(plan, **kw)

    def hooked_launch(plan):
        log.append(("step", calls[0], sorted({c.sid for c in plan})))
        return launch(plan)

    def hooked_prompts(chunks):
        log.append(("late", calls[0], sorted({c.sid for c in chunks})))
        launched = launch_prompts(chunks)
        for i in after_late.pop(sum(e[0] == "late" for e in log) - 1, []):
            add(i)
        return launched

    runner.run, runner._launch, runner.queue._launch_prompts = hooked_run, hooked_launch, hooked_prompts
    cols: dict[int, list] = {}
    reasons: dict[int, str] = {}
    want = sum(len(v) for v in arrive_during.values()) + sum(len(v) for v in after_late.values())
    while len(reasons) < want:
        sync = sync_every > 0 and (calls[0] // sync_every) % 2 == 1
        for ev in engine.step(sync=sync):
            i = sids[ev.stream_id]
            if ev.frame is not None:
                cols.setdefault(i, []).append(ev.frame)
            if ev.finished:
                reasons[i] = ev.reason
        assert runner.in_flight <= (0 if sync else 1 + LATE_PER_STEP)
        calls[0] += 1
        assert calls[0] < 600, "engine did not finish"
    while engine.has_work():
        assert engine.step() == []
    k = engine.cfg.num_codebooks
    frames = {i: np.stack(cols[i], axis=1) if i in cols else np.zeros((k, 0), np.int64) for i in reasons}
    return frames, reasons, log


@pytest.mark.parametrize("arrive_during, sync_every", [({0: [0], 3: [1, 2], 4: [3], 9: [4]}, 0),
                                                       ({0: [0], 2: [1, 2, 3, 4]}, 0),
                                                       ({0: [0], 4: [1, 2], 5: [3], 10: [4]}, 3)])
def test_late_prompts_give_the_frames_of_the_next_step_admission(model, tokenizer, arrive_during, sync_every):
    classic_frames, classic_reasons, classic_log = drive(make(model, tokenizer, False), arrive_during, sync_every)
    late_engine = make(model, tokenizer, True)
    frames, reasons, log = drive(late_engine, arrive_during, sync_every)
    assert reasons == classic_reasons and list(reasons.values()).count("length") >= 3
    for i, want in classic_frames.items():
        assert frames[i].shape == want.shape and np.array_equal(frames[i], want), f"request {i} differs"
    assert not any(e[0] == "late" for e in classic_log)
    lates = [entry for entry in log if entry[0] == "late"]
    assert lates and late_engine.runner.late_launches == len(lates)
    arrived = {e[2]: (e[1], e[3]) for e in log if e[0] == "add"}
    for _, call, sids in lates:  # launched during the call they arrived in, or later if the batch was full then
        assert all(arrived[sid][0] == call or (arrived[sid][0] < call and arrived[sid][1]) for sid in sids)
    assert sum(arrived[sid][0] == call for _, call, sids in lates for sid in sids) >= 2
    assert late_engine.cache.allocator.num_used == 1  # every stream's pages back; the graph rows' scratch page
    assert len(late_engine.runner._free_slots) == late_engine.config.max_batch


def test_a_prompt_arriving_after_a_late_launch_gets_one_of_its_own(model, tokenizer):
    """Request 1 arrives in call 2 and is launched late; request 3 comes right after that launch, while the
    host still waits for the same step, and request 4 right after request 3's launch: request 3 gets a late launch
    of its own in the same call, request 4 (the third since the last regular launch: LATE_PER_STEP = 2) rides
    the next regular step instead. Greedy frames equal those of classic admission of the same arrivals."""
    assert LATE_PER_STEP == 2
    arrivals, after = {0: [2], 2: [1]}, {0: [3], 1: [4]}
    late_frames, late_reasons, log = drive(make(model, tokenizer, True), arrivals, arrive_after_late=after)
    lates = [e for e in log if e[0] == "late"]
    assert lates[:2] == [("late", 2, [1]), ("late", 2, [2])]  # sids: request 2 -> 0, 1 -> 1, 3 -> 2, 4 -> 3
    first_of_4 = next(e for e in log if e[0] != "add" and 3 in e[2])
    assert first_of_4[0] == "step" and first_of_4[1] > 2 and log.index(first_of_4) > log.index(lates[1])
    classic = make(model, tokenizer, False)  # the same prompts admitted by regular steps, one call later
    classic_frames, classic_reasons, _ = drive(classic, {0: [2], 2: [1], 3: [3, 4]})
    assert late_reasons == classic_reasons
    for i, want in classic_frames.items():
        assert np.array_equal(late_frames[i], want), f"request {i} differs"


def test_a_late_prompt_is_launched_before_the_next_decode_step(model, tokenizer):
    """A prompt arriving during call 2 (another stream decoding): classic, its prompt goes into call 3's
    step beside the decode row; late, into a launch of its own before that step."""
    _, _, classic = drive(make(model, tokenizer, False), {0: [2], 2: [1]})
    _, _, late = drive(make(model, tokenizer, True), {0: [2], 2: [1]})
    newcomer = 1  # engine sequence ids count from 0 per engine: request 2 is sid 0, request 1 sid 1
    first_classic = next(e for e in classic if e[0] != "add" and newcomer in e[2])
    first_late = next(e for e in late if e[0] != "add" and newcomer in e[2])
    assert first_classic[0] == "step" and first_classic[2] == [0, 1]  # shares the next step with sid 0
    assert first_late == ("late", 2, [newcomer])  # alone, during the call it arrived in


def test_without_late_prompts_in_bursts_a_prompt_behind_a_prompted_step_rides_the_next_step(model, tokenizer):
    """`late_prompts_in_bursts=False`: request 1 arrives during call 2, whose regular launch carries request 2's
    prompt (request 0 decoding, its step 1 in flight): no late launch, it rides call 3's regular step (the default
    launches it late in call 2); arriving during a call whose regular step only decodes, it is still launched late.
    Greedy frames equal classic admission's."""
    arrivals, newcomer = {0: [0], 1: [2], 2: [1]}, 2  # sids: request 0 -> 0, 2 -> 1, 1 -> 2
    _, _, bursty = drive(make(model, tokenizer, True), arrivals)
    assert ("late", 2, [newcomer]) in bursty
    frames, reasons, log = drive(make(model, tokenizer, True, in_bursts=False), arrivals)
    assert not any(e[0] == "late" for e in log)
    assert next(e for e in log if e[0] != "add" and newcomer in e[2]) == ("step", 3, [0, 1, newcomer])
    classic_frames, classic_reasons, _ = drive(make(model, tokenizer, False), arrivals)
    assert reasons == classic_reasons
    for i, want in classic_frames.items():
        assert np.array_equal(frames[i], want), f"request {i} differs"
    _, _, log = drive(make(model, tokenizer, True, in_bursts=False), {0: [2], 2: [1]})
    assert ("late", 2, [1]) in log  # behind a decode-only step (request 2 decoding): late as by default


def test_a_failing_late_launch_fails_its_streams_alone(model, tokenizer, monkeypatch):
    engine = make(model, tokenizer, True)
    broken = iter([True])

    def launch_prompts(chunks, real=engine.runner.queue._launch_prompts):
        if next(broken, False):
            raise RuntimeError("device fault")
        return real(chunks)

    monkeypatch.setattr(engine.runner.queue, "_launch_prompts", launch_prompts)
    frames, reasons, _ = drive(engine, {0: [2], 2: [1], 5: [3]})
    assert reasons[1] == "error" and frames[1].shape[1] == 0  # the one that arrived late first
    assert reasons[2] == "length" and frames[2].shape[1] == 25 and reasons[3] in ("length", "stop")
    assert engine.cache.allocator.num_used == 1 and len(engine.runner._free_slots) == engine.config.max_batch


def test_folding_families_do_not_take_late_prompts(tiny_ckpt):
    """Higgs v2 folds its first decode token into the prompt's step: a late launch could not hold it, so
    its runner cannot take late prompts (the engine runs classic steps) and its scheduler refuses late
    admission; v2's greedy codes with the option on equal those with it off."""
    config = EngineConfig(kv_pages=64, max_batch=2, late_prompts=True)
    eng = Engine.from_pretrained(str(tiny_ckpt), config=config, runner=REF)
    assert not eng.runner.late_prompts
    with pytest.raises(ConfigError, match="folding"):
        eng.scheduler.admit_late(1)
    off = Engine.from_pretrained(str(tiny_ckpt), config=replace(config, late_prompts=False), runner=REF)
    request = GenerationRequest("Hello there.", sampling=GREEDY, max_frames=20)
    assert np.array_equal(eng.generate(request), off.generate(request))
