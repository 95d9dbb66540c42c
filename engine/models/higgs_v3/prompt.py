"""Higgs Audio v3 prompt: a request -> the talker's prompt positions.

Prompt (research/higgs_v3_peers.md §1.4; identical in sglang-omni and vllm-omni):

    zero-shot    <|tts|> <|text|> {text} <|audio|>
    voice clone  <|tts|> [<|ref_text|> {ref text}] <|ref_audio|> {T+7 delayed reference rows} <|text|> {text} <|audio|>

Reference codes [8, T] are delayed WITHOUT BOS/EOS frames (v2 wraps them; v3 does not): T + 7
rows, BOC (1024) above the diagonal and EOC (1025) below. Each row is one audio position; its text
id is the filler `<|tts|>` (never `<|audio|>`, which is the decode-step continuation token).
Inline tags such as `<|emotion:happy|>` are ordinary text and pass through the tokenizer.
Long-form history segments join the reference slot (see `build_prompt_v3`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.family import Prompt
from higgs_stream.engine.models.delay_pattern import build_delay_pattern
from higgs_stream.engine.models.higgs_v3.config import V3SpecialTokens
from higgs_stream.engine.request import GenerationRequest, refuse_fields


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


# ------------------------------------------------------------------------------------ prompt
def delayed_reference_rows(codes: np.ndarray, boc: int = 1024, eoc: int = 1025) -> np.ndarray:
    """Reference codes [K, T] -> delayed rows [T + K - 1, K] (no BOS/EOS frames, unlike v2)."""
    assert codes.ndim == 2 and codes.shape[1] >= 1, f"codes must be [K, T>=1], got {codes.shape}"
    return np.ascontiguousarray(build_delay_pattern(codes.astype(np.int64), boc, eoc).T)


def _user_text(tok: Encoder, special: V3SpecialTokens, text: str, what: str) -> list[int]:
    """The ids of user text; InvalidInputError when it holds one of the v3 control tokens."""
    ids = list(tok.encode(text))
    bad = sorted(set(ids) & {v for v in special.as_dict().values() if v is not None})
    if bad:
        raise InvalidInputError(f"{what} contains v3 control tokens (ids {bad}); remove them")
    return ids


def check_transcript(tok: Encoder, special: V3SpecialTokens, transcript: str) -> None:
    """InvalidInputError when `transcript` holds a v3 control token: the check `build_prompt_v3` runs on the
    reference transcript."""
    _user_text(tok, special, transcript, "reference transcript")


def build_prompt_v3(
    tok: Encoder, special: V3SpecialTokens, request: GenerationRequest, num_codebooks: int = 8,
    codebook_size: int = 1024,
) -> Prompt:
    """The v3 prompt of `request`; InvalidInputError for what v3 cannot express or bad codes.

    v3 has one audio-conditioning slot, the voice-clone reference. Long-form history (earlier
    segments of the same context, what the streaming pipeline sends for reference-less contexts)
    goes there too: reference then history segments, oldest first, concatenated in time, their
    transcripts joined by spaces. A scene or system text has no place in the v3 prompt.
    """
    if request.scene or request.system or request.instructions:
        raise InvalidInputError("the v3 prompt has no scene, system text or instructions; send text (+ reference) only")
    refuse_fields(request, ("speaker", "language", "stream_text", "embedding"), "Higgs Audio v3")
    request.check_codes(num_codebooks, codebook_size)
    segments = request.audio_segments

    ids: list[int] = [special.tts]
    rows = np.zeros((0, num_codebooks), np.int64)
    ref_start = 0
    if segments:
        if special.ref_text is None:
            raise InvalidInputError("this checkpoint's tokenizer has no <|ref_text|>: it cannot take a reference transcript")
        transcript = " ".join(seg.transcript for seg in segments)
        codes = np.concatenate([seg.codes for seg in segments], axis=1)  # [K, T]
        ids += [special.ref_text] + _user_text(tok, special, transcript, "reference transcript") + [special.ref_audio]
        rows = delayed_reference_rows(codes, codebook_size, codebook_size + 1)  # [T + 7, K]
        ref_start = len(ids)
        ids += [special.tts] * rows.shape[0]  # filler text id at the audio positions
    ids += [special.text] + _user_text(tok, special, request.text, "text") + [special.audio]

    n = len(ids)
    codes = np.zeros((n, num_codebooks), np.int64)
    is_audio = np.zeros(n, bool)
    codes[ref_start:ref_start + rows.shape[0]] = rows
    is_audio[ref_start:ref_start + rows.shape[0]] = True
    return Prompt(input_ids=np.array(ids, np.int64), audio_codes=codes, is_audio=is_audio,
                  audio_out=np.ascontiguousarray(rows.T), text_pad=special.audio)  # decode steps: <|audio|>
