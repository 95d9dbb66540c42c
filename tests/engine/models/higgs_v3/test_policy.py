"""v3 prompt format and the row state machine (sglang-omni's sampler), on hand-checkable examples.

Where sglang-omni (followed) and vllm-omni (not followed) differ, the tests below pin our side:
no logit masking (active codebooks keep a sampled BOC/EOC), an EOC countdown of 6 (E + 7 rows,
no residual frame; vllm-omni counts 7 and trims a residual frame), no EOC locking of the lower
codebooks during ramp-down, and EOC on codebook 0 ignored inside the ramp-up window.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.models.higgs_v3.config import V3_SPECIAL_TOKEN_STRINGS, TalkerV3Config, V3SpecialTokens
from higgs_stream.engine.models.higgs_v3.make_checkpoint import build_v3_tokenizer
from higgs_stream.engine.models.higgs_v3.policy import RowState, V3Policy, V3Segment
from higgs_stream.engine.models.higgs_v3.prompt import build_prompt_v3, delayed_reference_rows
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
from higgs_stream.engine.sampling import SamplingTensors, sample_columns
from higgs_stream.engine.tokenizer import TextTokenizer

BOC, EOC, K = 1024, 1025, 8


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer(build_v3_tokenizer(288, tuple(V3_SPECIAL_TOKEN_STRINGS.values())), specials=V3SpecialTokens)


@pytest.fixture(scope="module")
def cfg(tok) -> TalkerV3Config:
    return TalkerV3Config.tiny().with_special(tok.special)


# ------------------------------------------------------------------------------------ prompt
def test_specials_and_stop_ids_come_from_the_tokenizer(tok, cfg):
    s = tok.special
    assert (s.tts, s.text, s.audio, s.ref_audio, s.ref_text, s.end_of_text, s.audio_end) == tuple(range(288, 295))
    assert tok.token_id("<|endoftext|>") == s.end_of_text and tok.token_id("<|audio_end|>") == s.audio_end
    assert V3Policy(cfg, tok).stop_ids == (s.end_of_text, s.audio_end) == (293, 294)


def test_zero_shot_prompt(tok, cfg):
    text = "Hello world."
    p = build_prompt_v3(tok, cfg.special, GenerationRequest(text=text))
    s = cfg.special
    assert p.input_ids.tolist() == [s.tts, s.text] + tok.encode(text) + [s.audio]
    assert not p.is_audio.any() and p.audio_out.shape == (K, 0)


def test_delayed_reference_rows_by_hand():
    codes = np.array([[10 + k, 20 + k] for k in range(K)])  # [8, T=2]
    rows = delayed_reference_rows(codes)  # [T + 7 = 9, 8]
    assert rows.shape == (9, K)
    # row r, codebook k: codes[k, r - k] inside, BOC before (r < k), EOC after (r - k >= 2)
    assert rows[0].tolist() == [10] + [BOC] * 7
    assert rows[1].tolist() == [20, 11] + [BOC] * 6
    assert rows[2].tolist() == [EOC, 21, 12] + [BOC] * 5
    assert rows[7].tolist() == [EOC] * 6 + [26, 17]
    assert rows[8].tolist() == [EOC] * 7 + [27]


def test_voice_clone_prompt(tok, cfg):
    s = cfg.special
    codes = np.arange(K * 3).reshape(K, 3) + 100  # T = 3 -> 10 delayed rows
    req = GenerationRequest(text="Say this.", reference=Reference(codes=codes, transcript="Ref words."))
    p = build_prompt_v3(tok, s, req)
    ref_ids, text_ids = tok.encode("Ref words."), tok.encode("Say this.")
    head = [s.tts, s.ref_text] + ref_ids + [s.ref_audio]
    assert p.input_ids.tolist() == head + [s.tts] * 10 + [s.text] + text_ids + [s.audio]
    audio_rows = np.flatnonzero(p.is_audio)
    assert audio_rows.tolist() == list(range(len(head), len(head) + 10))
    assert np.array_equal(p.audio_codes[p.is_audio], delayed_reference_rows(codes))
    assert (p.audio_codes[~p.is_audio] == 0).all()
    assert s.audio not in p.input_ids[p.is_audio]  # the filler is <|tts|>, never the continuation token


def test_history_joins_the_reference_slot(tok, cfg):
    s = cfg.special
    ref = Reference(codes=np.full((K, 2), 5), transcript="First.")
    hist = (("Second part.", np.full((K, 3), 6)),)
    p = build_prompt_v3(tok, s, GenerationRequest(text="Third.", reference=ref, history=hist))
    joined = tok.encode("First. Second part.")
    assert p.input_ids[: 2 + len(joined) + 1].tolist() == [s.tts, s.ref_text] + joined + [s.ref_audio]
    codes = np.concatenate([np.full((K, 2), 5), np.full((K, 3), 6)], axis=1)
    assert np.array_equal(p.audio_codes[p.is_audio], delayed_reference_rows(codes))  # 5 + 7 rows
    alone = build_prompt_v3(tok, s, GenerationRequest(text="Third.", history=(("First.", np.full((K, 2), 5)),)))
    same = build_prompt_v3(tok, s, GenerationRequest(text="Third.", reference=Reference(np.full((K, 2), 5), "First.")))
    assert np.array_equal(alone.input_ids, same.input_ids) and np.array_equal(alone.audio_codes, same.audio_codes)


def test_inline_tags_pass_through_as_text(tok, cfg):
    text = "Well <|emotion:happy|> hello [laugh]"
    p = build_prompt_v3(tok, cfg.special, GenerationRequest(text=text))
    assert p.input_ids[2:-1].tolist() == tok.encode(text)


@pytest.mark.parametrize("req,match", [
    (dict(text="stop <|audio|> here"), "control tokens"),
    (dict(text="x <|endoftext|>"), "control tokens"),
    (dict(text="hi", scene="a quiet room"), "no scene"),
    (dict(text="hi", system="be nice"), "no scene"),
    (dict(text="hi", history=(("earlier", np.full((K, 2), 1025)),)), "history codes must lie"),
    (dict(text="hi", reference=Reference(codes=np.full((K, 2), 1024), transcript="r")), "0..1023"),
    (dict(text="hi", reference=Reference(codes=np.zeros((4, 2), np.int64), transcript="r")), "8 codebooks"),
])
def test_prompt_rejects(tok, cfg, req, match):
    with pytest.raises(InvalidInputError, match=match):
        build_prompt_v3(tok, cfg.special, GenerationRequest(**req))


def test_check_transcript_is_the_reference_transcript_check(tok, cfg):
    policy = V3Policy(cfg, tok)
    policy.check_transcript("Well <|emotion:happy|> hello [laugh]")  # inline tags are text
    for bad in ("stop <|audio|> here", "x <|endoftext|>", "a <|ref_text|> b"):
        with pytest.raises(InvalidInputError, match="^reference transcript contains v3 control tokens") as alone:
            policy.check_transcript(bad)
        with pytest.raises(InvalidInputError) as in_prompt:
            policy.build_prompt(GenerationRequest(text="hi", reference=Reference(np.full((K, 2), 5), bad)))
        assert str(alone.value) == str(in_prompt.value)


# ----------------------------------------------------------------------------- state machine
def greedy_rows(wanted: list[list[int]]) -> list[list[int]]:
    """Fake logits whose argmax is `wanted`, sampled through the engine's sampler at temperature 0."""
    logits = torch.full((len(wanted), K, 1026), -5.0)
    for i, row in enumerate(wanted):
        logits[i, torch.arange(K), torch.tensor(row)] = 5.0
    params = [SamplingParams(temperature=0.0, seed=0)] * len(wanted)
    st = SamplingTensors.build(params, 1026, logits.device)
    gens = [torch.Generator().manual_seed(0) for _ in wanted]
    return sample_columns(logits, st, gens)[:, 0].tolist()


def test_state_machine_hand_example():
    """Rows 0..7 ramp up; cb0 EOC at row 3 is ignored (ramp window); EOC at row E = 12 starts a
    countdown of 6: rows 13..18 follow, row 18 is the last: E + 7 = 19 rows -> E = 12 frames."""
    wanted = [[50 * r + k for k in range(K)] for r in range(19)]
    wanted[3][0] = EOC  # inside the ramp window: not an end
    wanted[9][4] = BOC  # an active codebook sampling BOC keeps it (no masking, unlike vllm-omni)
    wanted[10][2] = EOC  # likewise EOC on a codebook other than 0
    wanted[12][0] = EOC  # the end of speech
    sampled = greedy_rows(wanted)
    assert sampled == wanted

    seg = V3Segment(K, 1024, max_frames=1000)
    cols = seg.start()
    assert cols == []  # no forced start row: row 0 is sampled at the prompt's end
    writer = V3Policy(TalkerV3Config.tiny(), None).new_writer()
    frames_out = []
    frames_after = []
    for r, row in enumerate(sampled):
        assert not seg.finished
        out = seg.advance(row)
        cols += out
        frames_out += [f for f in (writer.push(c, final=seg.finished) for c in out) if f is not None]
        frames_after.append(seg.state.num_frames)
        assert len(frames_out) == seg.state.num_frames  # the writer yields each frame when its last row comes
        if r < 8:  # ramp-up: codebooks > r are BOC
            assert out[0] == tuple(row[: r + 1] + [BOC] * (K - r - 1))
        else:
            assert out[0] == tuple(row)  # sampled values kept verbatim, ramp-down included (no EOC locking)
        if r == 12:
            assert seg.state.eoc_countdown == 6 and seg.state.eoc_row == 12
        if 12 < r < 18:
            assert seg.state.eoc_countdown == 18 - r and len(out) == 1
    assert seg.finished and seg.reason == "stop" and len(seg.state.rows) == 19  # E + 7 (vllm-omni: E + 8)
    assert len(cols) == 19 and cols == [tuple(r) for r in seg.as_array().T.tolist()]  # the rows, nothing synthetic
    assert seg.last_column == tuple(sampled[18])  # the next input would be the last real row
    # row/frame arithmetic: frame f needs rows f .. f + 7, so after row r there are r - 6 frames
    assert frames_after == [0] * 7 + list(range(1, 13))

    frames = np.array(frames_out).T  # [8, R - 7]
    assert frames.shape == (K, 12)  # exactly E frames: no residual frame to trim
    for f in range(12):
        for k in range(K):
            expect = wanted[f + k][k]
            if expect >= 1024:  # stray ids: the codebook's previous valid code (the writer's stray fill)
                expect = frames[k, f - 1]
            assert frames[k, f] == expect, (f, k)
    assert frames[0, 3] == wanted[2][0]  # the ramp-window EOC became the previous cb0 code
    assert frames[4, 5] == wanted[8][4]  # row 9 cb 4 is frame 5's; its BOC became frame 4's code
    assert frames[7, 11] == wanted[18][7]  # the last row completes the last (real) frame


def test_frame_cap_ends_after_exactly_max_frames():
    seg = V3Segment(K, 1024, max_frames=5)
    writer = V3Policy(TalkerV3Config.tiny(), None).new_writer()
    rows = seg.start()
    n, frames = 0, []
    while not seg.finished:
        out = seg.advance([7] * K)
        rows += out
        frames += [f for f in (writer.push(r, final=seg.finished) for r in out) if f is not None]
        n += 1
    assert n == 5 + 7 and seg.reason == "length" and len(rows) == n
    assert np.array(frames).T.shape == (K, 5)


def test_eoc_at_first_allowed_row_gives_eight_frames():
    st = RowState(K, 1024, max_frames=100)
    for r in range(15):
        st.advance([EOC if r == 8 else 1] + [2] * 7)
    assert st.finished and st.eoc_row == 8 and len(st.rows) == 15 and st.num_frames == 8


def test_countdown_wins_over_cap_only_when_it_ends_first():
    """cap rows = max_frames + 7; EOC at row 10 would end at row 16 (17 rows) -> with max_frames 9
    (cap 16 rows) the cap ends it first with reason 'length' and 9 real frames (all before E)."""
    st = RowState(K, 1024, max_frames=9)
    r = 0
    while not st.finished:
        st.advance([EOC if r == 10 else 3] + [4] * 7)
        r += 1
    assert st.reason == "length" and len(st.rows) == 16 and st.num_frames == 9 < st.eoc_row
