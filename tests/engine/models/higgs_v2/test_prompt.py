"""Prompt building against REF's piecewise ChatML rendering, and pinned differences from the HF port.

The expected ids are produced the way REF's `prepare_chatml_sample` does it: each piece (turn
prefix, content item, postfix) written as a STRING with its special tokens spelled out and
encoded on its own; the single `<|AUDIO_OUT|>` of an assistant audio item then stands for T + 9
positions. Our builder works on ids; the two must agree exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from transformers import HiggsAudioV2Processor

from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.models.delay_pattern import delayed_prompt_audio
from higgs_stream.engine.models.higgs_v2.config import SpecialTokens
from higgs_stream.engine.models.higgs_v2.prompt import build_prompt
from higgs_stream.engine.request import GenerationRequest, Reference
from higgs_stream.engine.tokenizer import TextTokenizer

SYSTEM_WITH_SCENE = ("Generate audio following instruction.\n\n<|scene_desc_start|>\n"
                     "Audio is recorded from a quiet room.\n<|scene_desc_end|>")


@pytest.fixture(scope="module")
def tok(tiny_ckpt) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_ckpt, SpecialTokens)


def codes(t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(8, t))


def ref_pieces(system: str | None, turns: list[tuple[str, object]]) -> list[object]:
    """REF's piece list: strings, or an int n standing for n audio positions."""
    messages = ([("system", system)] if system is not None else []) + turns
    pieces: list[object] = []
    for i, (role, content) in enumerate(messages):
        pieces.append(("<|begin_of_text|>" if i == 0 else "") + f"<|start_header_id|>{role}<|end_header_id|>\n\n")
        if isinstance(content, str):
            pieces.append(content)
        else:  # assistant audio: <|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>, AUDIO_OUT -> T+9 positions
            pieces += ["<|audio_out_bos|>", content.shape[1] + 9, "<|audio_eos|>"]
        pieces.append("<|eot_id|>")
    pieces += ["<|start_header_id|>assistant<|end_header_id|>\n\n", "<|audio_out_bos|>"]
    return pieces


def ref_ids(tok: TextTokenizer, pieces: list[object]) -> list[int | None]:
    """Ids of the pieces; None marks an audio position."""
    out: list[int | None] = []
    for p in pieces:
        out += [None] * p if isinstance(p, int) else tok.encode(p)
    return out


def assert_matches_ref(tok: TextTokenizer, prompt, expected: list[int | None]) -> None:
    assert len(prompt) == len(expected)
    is_audio = np.array([e is None for e in expected])
    np.testing.assert_array_equal(prompt.is_audio, is_audio)
    np.testing.assert_array_equal(prompt.input_ids[~is_audio], [e for e in expected if e is not None])
    assert (prompt.input_ids[is_audio] == tok.special.audio_out).all()


def test_default_prompt_text_and_ids(tok):
    prompt = build_prompt(tok, GenerationRequest(text="Hello world."))
    expected_text = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + SYSTEM_WITH_SCENE + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello world.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|audio_out_bos|>"
    )
    assert tok.decode(prompt.input_ids.tolist()) == expected_text
    assert_matches_ref(tok, prompt, ref_ids(tok, ref_pieces(SYSTEM_WITH_SCENE, [("user", "Hello world.")])))
    assert prompt.input_ids[-1] == tok.special.audio_out_bos and prompt.input_ids[0] == tok.special.begin_of_text
    assert not prompt.is_audio.any() and prompt.audio_out.shape == (8, 0)


def test_voice_clone_with_history(tok):
    ref = Reference(codes(5, 0), "Good morning! How are you today?")
    hist = [("The quick brown fox.", codes(3, 1)), ("It's a beautiful day,\n isn't it? ", codes(4, 2))]
    req = GenerationRequest(text="  Please call me back. ", reference=ref, history=tuple(hist),
                            scene="Music, laughter, applause.")
    prompt = build_prompt(tok, req)
    system = ("Generate audio following instruction.\n\n<|scene_desc_start|>\nMusic, laughter, applause."
              "\n<|scene_desc_end|>")
    turns = [("user", ref.transcript), ("assistant", ref.codes)]
    for text, c in hist:
        turns += [("user", text), ("assistant", c)]
    turns.append(("user", "  Please call me back. "))  # REF does not strip content text
    assert_matches_ref(tok, prompt, ref_ids(tok, ref_pieces(system, turns)))
    # audio rows carry the BOS/EOS-wrapped, delayed codes of each segment in order: 14 + 12 + 13
    segs = [delayed_prompt_audio(ref.codes)] + [delayed_prompt_audio(c) for _, c in hist]
    assert [s.shape[1] for s in segs] == [14, 12, 13]
    np.testing.assert_array_equal(prompt.audio_codes[prompt.is_audio].T, np.concatenate(segs, axis=1))
    np.testing.assert_array_equal(prompt.audio_out, np.concatenate(segs, axis=1))
    assert (prompt.audio_codes[~prompt.is_audio] == 0).all()


def test_scene_and_system_options(tok):
    no_scene = build_prompt(tok, GenerationRequest(text="Hi.", scene=""))
    assert_matches_ref(tok, no_scene, ref_ids(tok, ref_pieces("Generate audio following instruction.",
                                                              [("user", "Hi.")])))
    custom = build_prompt(tok, GenerationRequest(text="Hi.", system="Convert text to speech with the same voice.",
                                                 scene=""))
    assert "Convert text to speech" in tok.decode(custom.input_ids.tolist())
    assert_matches_ref(tok, custom, ref_ids(tok, ref_pieces("Convert text to speech with the same voice.",
                                                            [("user", "Hi.")])))


def test_sound_event_tags_allowed_control_tokens_refused(tok):
    p = build_prompt(tok, GenerationRequest(text="Ha <SE>[Laughter]</SE> ok."))
    assert tok.token_id("<SE>") in p.input_ids.tolist()
    for bad in ("hi<|eot_id|>", "<|start_header_id|>system", "x<|audio_out_bos|>", "<|AUDIO_OUT|>"):
        with pytest.raises(InvalidInputError, match="control tokens"):
            build_prompt(tok, GenerationRequest(text=bad))
    with pytest.raises(InvalidInputError, match="control tokens"):
        build_prompt(tok, GenerationRequest(text="ok", reference=Reference(codes(2, 0), "a<|eom_id|>")))
    for field in ("scene", "instructions"):  # named as the client sent it (instructions was reported as scene)
        with pytest.raises(InvalidInputError, match=f"^{field} contains chat/audio control tokens"):
            build_prompt(tok, GenerationRequest(text="ok", **{field: "a room<|eot_id|>"}))


def test_bad_reference_codes_refused(tok):
    with pytest.raises(InvalidInputError, match="8 codebooks"):
        build_prompt(tok, GenerationRequest(text="x", reference=Reference(codes(3, 0)[:4], "t")))
    c = codes(3, 0)
    c[2, 1] = 1024  # a stream BOS id is not a codec code
    with pytest.raises(InvalidInputError, match="0..1023"):
        build_prompt(tok, GenerationRequest(text="x", reference=Reference(c, "t")))
    with pytest.raises(InvalidInputError):
        Reference(np.zeros((8, 0), np.int64), "t")
    with pytest.raises(InvalidInputError):
        GenerationRequest(text="   ")


# ---------------------------------------------------------------------------- HF port differences
def test_hf_port_differences_are_pinned(tok):
    """Where transformers' HiggsAudioV2 chat template / processor differs from REF (we follow REF).

    1. The HF template `trim`s every text item; REF keeps it as written.
    2. HF spells an audio item as (n - 7) `<|AUDIO_OUT|>` + 7 `<|reserved_special_token_6|>`
       placeholders; REF (and we) use n `<|AUDIO_OUT|>` positions. Same count, n = T + 9, and the
       talker ignores the text id at audio rows, so the model input is identical.
    """
    text = "  Hello world.\n"
    ours = build_prompt(tok, GenerationRequest(text=text))
    user_ids = tok.encode(text)
    ids = ours.input_ids.tolist()
    tail = len(tok.encode("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<|audio_out_bos|>"))
    assert ids[len(ids) - tail - len(user_ids) : len(ids) - tail] == user_ids  # kept untrimmed
    trimmed = build_prompt(tok, GenerationRequest(text=text.strip()))
    assert len(trimmed) < len(ours)  # what HF's trim would give: a different prompt

    ref = codes(6, 3)
    ns = SimpleNamespace(audio_token="<|AUDIO_OUT|>", audio_delay_token="<|reserved_special_token_6|>",
                         audio_tokenizer=SimpleNamespace(config=SimpleNamespace(num_quantizers=8)))
    n = delayed_prompt_audio(ref).shape[1]
    hf_placeholders = HiggsAudioV2Processor.get_audio_tokens(ns, n)
    assert hf_placeholders.count("<|AUDIO_OUT|>") + hf_placeholders.count("<|reserved_special_token_6|>") == n == 6 + 9
    p = build_prompt(tok, GenerationRequest(text="x", reference=Reference(ref, "y")))
    assert int(p.is_audio.sum()) == n
