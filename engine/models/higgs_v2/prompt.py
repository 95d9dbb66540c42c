"""A request -> the talker's prompt positions, exactly as Boson's original builds them.

Llama-3 chat format (REF `prepare_chatml_sample`, research/higgs_v2_reference.md §3.2):

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{reference transcript}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>[T+9 audio columns]<|audio_eos|><|eot_id|>
    ... one user/assistant pair per history segment ...
    <|start_header_id|>user<|end_header_id|>\\n\\n{text}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>

(no newlines between turns). Every piece (turn prefix, each content item, turn postfix) is
tokenized on its own and the ids concatenated, as REF does; content text is not stripped. The
system content is "Generate audio following instruction." followed, when there is a scene, by
"\\n\\n<|scene_desc_start|>\\n{scene}\\n<|scene_desc_end|>". The prompt always ends with
<|audio_out_bos|> (REF `force_audio_gen=True`): the next step is AUDIO_INIT.

Audio positions (is_audio) carry one delay-pattern column each (BOS/EOS-wrapped codes, delayed:
T + 9 columns for T frames); their text id is the <|AUDIO_OUT|> placeholder, which the talker
ignores at audio rows.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.family import Prompt, TokenizerLike
from higgs_stream.engine.models.delay_pattern import delayed_prompt_audio
from higgs_stream.engine.request import GenerationRequest, refuse_fields

DEFAULT_SYSTEM = "Generate audio following instruction."
DEFAULT_SCENE = "Audio is recorded from a quiet room."

# Chat-structure tokens that user-supplied text may not contain (the sound-event tags may).
_STRUCTURAL = ("begin_of_text", "end_of_text", "start_header", "end_header", "eot", "eom",
               "audio_bos", "audio_eos", "audio_out_bos", "audio_in", "audio_out")


class _Builder:
    def __init__(self, tok: TokenizerLike, num_codebooks: int) -> None:
        self.tok = tok
        self.sp = tok.special
        self.k = num_codebooks
        self.ids: list[int] = []
        self.codes: list[np.ndarray] = []  # one [n, K] block per run of positions
        self.audio: list[bool] = []
        self.turns = 0
        self._forbidden = {getattr(self.sp, name) for name in _STRUCTURAL}

    def text(self, piece: str, what: str = "", *, user: bool = False) -> None:
        ids = list(self.tok.encode(piece))
        if user:
            bad = sorted(set(ids) & self._forbidden)
            if bad:
                raise InvalidInputError(f"{what} contains chat/audio control tokens (ids {bad}); remove them")
        self.tokens(ids)

    def tokens(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self.codes.append(np.zeros((len(ids), self.k), np.int64))
        self.audio.extend([False] * len(ids))

    def header(self, role: str) -> None:
        """`[<|begin_of_text|>]<|start_header_id|>{role}<|end_header_id|>\\n\\n` as REF's prefix piece."""
        if self.turns == 0:
            self.tokens([self.sp.begin_of_text])
        self.tokens([self.sp.start_header])
        self.text(role)
        self.tokens([self.sp.end_header])
        self.text("\n\n")
        self.turns += 1

    def audio_columns(self, cols: np.ndarray) -> None:
        """[K, n] delay-pattern columns as n audio positions."""
        n = cols.shape[1]
        self.ids.extend([self.sp.audio_out] * n)
        self.codes.append(np.ascontiguousarray(cols.T))
        self.audio.extend([True] * n)

    def user_turn(self, text: str, what: str) -> None:
        self.header("user")
        self.text(text, what, user=True)
        self.tokens([self.sp.eot])

    def assistant_audio_turn(self, cols: np.ndarray) -> None:
        self.header("assistant")
        self.tokens([self.sp.audio_out_bos])
        self.audio_columns(cols)
        self.tokens([self.sp.audio_eos, self.sp.eot])

    def build(self) -> Prompt:
        codes = np.concatenate(self.codes, axis=0) if self.codes else np.zeros((0, self.k), np.int64)
        is_audio = np.array(self.audio, dtype=bool)
        return Prompt(
            input_ids=np.array(self.ids, dtype=np.int64),
            audio_codes=codes,
            is_audio=is_audio,
            audio_out=np.ascontiguousarray(codes[is_audio].T),
            text_pad=self.sp.audio_out,  # every decode step is an <|AUDIO_OUT|> position
        )


def system_content(request: GenerationRequest) -> tuple[str, str | None]:
    """(system text, scene or None) of a request, defaults applied."""
    system = DEFAULT_SYSTEM if request.system is None else request.system
    scene = DEFAULT_SCENE if request.scene is None else request.scene
    return system, (scene if scene.strip() else None)


def check_transcript(tok: TokenizerLike, transcript: str, num_codebooks: int = 8) -> None:
    """InvalidInputError when `transcript` holds a chat/audio control token: the check `build_prompt` runs on the
    transcript of every audio segment (a reference's, a history segment's)."""
    _Builder(tok, num_codebooks).user_turn(transcript, "transcript")


def build_prompt(
    tok: TokenizerLike, request: GenerationRequest, num_codebooks: int = 8, codebook_size: int = 1024
) -> Prompt:
    """The expanded prompt of `request`; InvalidInputError on malformed codes or control tokens in text,
    or a field v2 cannot express. `instructions` is the scene description (OpenAI's field name)."""
    refuse_fields(request, ("speaker", "language", "stream_text", "embedding"), "Higgs Audio v2")
    scene_field = "scene"  # what an error calls it: the client's own field name
    if request.instructions is not None:
        if request.scene is not None:
            raise InvalidInputError("give either instructions or scene, not both")
        request = replace(request, scene=request.instructions, instructions=None)
        scene_field = "instructions"
    request.check_codes(num_codebooks, codebook_size)
    b = _Builder(tok, num_codebooks)
    bos, eos = codebook_size, codebook_size + 1

    system, scene = system_content(request)
    b.header("system")
    if scene is None:
        b.text(system, "system", user=True)
    else:  # REF tokenizes this one content string; the scene markers split it into these pieces
        b.text(system + "\n\n", "system", user=True)
        b.tokens([b.sp.scene_desc_start])
        b.text("\n" + scene + "\n", scene_field, user=True)
        b.tokens([b.sp.scene_desc_end])
    b.tokens([b.sp.eot])

    for seg in request.audio_segments:
        b.user_turn(seg.transcript, "transcript")
        b.assistant_audio_turn(delayed_prompt_audio(seg.codes, bos, eos))

    b.user_turn(request.text, "text")
    b.header("assistant")
    b.tokens([b.sp.audio_out_bos])
    return b.build()

