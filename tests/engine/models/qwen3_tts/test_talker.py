"""The Qwen3-TTS talker and code predictor against the official reference (PyPI qwen-tts 0.1.1;
fixtures by scripts/qwen3_reference_fixtures.py): prompt embeddings of the three variants, talker
logits at every prefill position and decode step, code-predictor logits per group, greedy frames."""

import numpy as np
import pytest
import torch
from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.models.qwen3_tts.generate import Trace, generate_frames
from higgs_stream.engine.models.qwen3_tts.prompt import build_prompt, embed_prompt

BOUND = 1e-5  # max |ours - reference| / max |reference|, fp32
SLICE = 65  # the fixtures' stored logit columns: codes 0..63 and EOS



def scenario(name, ref, cfg):
    """The request each fixture scenario ran (scripts/qwen3_reference_fixtures.py)."""
    a, b = ref["scenario_text_a"].tolist(), ref["scenario_text_b"].tolist()
    if name == "custom":
        return build_prompt(cfg, a, language="english", speaker="aiden"), 110
    if name == "design":
        return build_prompt(cfg, b, language="auto", instruct_ids=ref["scenario_instruct"].tolist(),
                            non_streaming=True), 23
    if name == "dialect":
        return build_prompt(cfg, b, language="chinese", speaker="dylan"), 11
    return build_prompt(cfg, a, language="english", speaker_vector=ref["clone_spk"],
                        ref_ids=ref["clone_ref_ids"].tolist(), ref_codes=ref["clone_ref_codes"]), 15


def rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{got.shape} vs {want.shape}"
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("name", ["custom", "design", "dialect", "clone"])
def test_prompt_and_logits_match_the_reference(model, ref, name):
    prompt, frames = scenario(name, ref, model.cfg)
    with torch.no_grad():
        embeds = embed_prompt(model, prompt).numpy()
    assert rel(embeds, ref[f"{name}_prompt_embeds"]) <= BOUND, "prompt embeddings"
    trace = Trace()
    got = generate_frames(model, prompt, frames, penalty=model.cfg.generation.repetition_penalty, trace=trace)
    pre = trace.prefill_logits.numpy()
    assert rel(pre[:, :SLICE], ref[f"{name}_prefill_logits"]) <= BOUND, "talker logits at the prefill positions"
    assert rel(pre[-1], ref[f"{name}_prefill_logits_last"]) <= BOUND, "talker logits (all ids) at the last position"
    steps = torch.stack(trace.step_logits).numpy()
    assert rel(steps[:, :SLICE], ref[f"{name}_step_logits"]) <= BOUND, "talker logits at the decode steps"
    if name == "custom":
        assert rel(steps[1:3], ref["custom_step_logits_full"]) <= BOUND
    cp = ref[f"{name}_cp_logits"]  # [n, 15, V]
    mine = np.stack([torch.stack(f).numpy() for f in trace.predictor_logits[: cp.shape[0]]])
    assert rel(mine, cp) <= BOUND, "code predictor logits per group"
    np.testing.assert_array_equal(got, ref[f"{name}_codes"].astype(np.int64), err_msg="greedy frames")
    assert got.shape == (frames, 16) and (frames < 100 or name == "custom")


def test_the_long_scenario_runs_110_greedy_frames(ref):
    assert ref["custom_codes"].shape == (110, 16)


def test_bad_requests_are_typed(model):
    cfg = model.cfg
    text = [cfg.im_start_id, 11, 13, 50, 51, cfg.im_end_id, 13, cfg.im_start_id, 11, 13]
    with pytest.raises(InvalidInputError, match="unknown speaker 'nobody'"):
        build_prompt(cfg, text, speaker="nobody")
    with pytest.raises(InvalidInputError, match="unknown language 'klingon'"):
        build_prompt(cfg, text, language="klingon")
    with pytest.raises(InvalidInputError, match="reference transcript"):
        build_prompt(cfg, text, ref_codes=np.zeros((3, 16), np.int64))
    with pytest.raises(InvalidInputError, match="chat template"):
        build_prompt(cfg, [1, 2, 3])
