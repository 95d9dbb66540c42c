"""Qwen3-TTS generation in the engine's loop: the request -> prompt mapping, the per-stream rule
machine and frame writer, and the group-0 logits processors (engine/family.py GenerationPolicy).

One talker step is one frame (no delay pattern): the talker's head samples group 0 at the prompt's
last position and at every decode step, the code predictor completes groups 1..15 in the same step
(`QwenTTSModel.complete_rows`), and the whole frame is fed back with the next text-track id
(the rest of the text when it streams, then tts_pad). Group 0 follows the reference's `generate`
(qwen-tts 0.1.1): ids >= codebook_size are suppressed except EOS, EOS is held off for the first
MIN_FRAMES frames, and a repetition penalty (the checkpoint's generation_config.json) applies to
group-0 ids already generated. EOS on group 0 ends the stream without a frame ("stop"); the frame
cap ends it after its last frame ("length"). Groups 1..15 are sampled with the request's
parameters too (the reference's "subtalker" settings default to the same values).

The request, per variant (the reference's `generate_custom_voice` / `generate_voice_design` /
`generate_voice_clone`):

    CustomVoice   speaker (default: the checkpoint's first), instructions (1.7B only), text in the prompt
    VoiceDesign   instructions ("" or None: none), text in the prompt
    Base          reference: codes [16, T] + transcript + speaker embedding (ICL), text streamed

`stream_text` overrides where the text goes; `language` None is "auto". What a variant cannot
express is an InvalidInputError naming it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from higgs_stream.engine.errors import ConfigError, InvalidInputError
from higgs_stream.engine.family import NO_ID, Prompt, TokenizerLike
from higgs_stream.engine.models.qwen3_tts.config import QwenTTSConfig
from higgs_stream.engine.models.qwen3_tts.generate import MIN_FRAMES
from higgs_stream.engine.models.qwen3_tts.prompt import NONE, QwenPrompt, build_prompt
from higgs_stream.engine.request import GenerationRequest, SamplingParams

Row = tuple[int, ...]

ASSISTANT = "<|im_start|>assistant\n{}<|im_end|>\n<|im_start|>assistant\n"  # the text to speak
REFERENCE = "<|im_start|>assistant\n{}<|im_end|>\n"  # the reference transcript (Base)
INSTRUCTION = "<|im_start|>user\n{}<|im_end|>\n"  # the voice / style instruction


class QwenSegment:
    """One stream's group-0 rules on the host (engine/family.py Segment): each sampled row is a
    whole frame; EOS on group 0 ends the stream without one."""

    def __init__(self, cfg: QwenTTSConfig, max_frames: int) -> None:
        assert max_frames >= 1, f"max_frames must be >= 1, got {max_frames}"
        self.k, self.eos, self.max_frames = cfg.num_codebooks, cfg.codec_eos_id, max_frames
        self.frames = 0  # frames emitted
        self.seen: set[int] = set()  # group-0 ids emitted (the repetition penalty's)
        self._last: Row | None = None
        self._reason: str | None = None

    def start(self) -> list[Row]:
        return []  # the prompt's last position is sampled: no forced start row

    def advance(self, sampled: Sequence[int], ras_candidate: Sequence[int] | None = None) -> list[Row]:
        """A sampled row (group 0 + the completed groups) -> [frame], or [] at EOS. No RAS."""
        assert self._reason is None, "advance() after the stream finished"
        row = tuple(int(x) for x in sampled)
        assert len(row) == self.k, f"a frame has {self.k} codes, got {len(row)}"
        if row[0] == self.eos:
            self._reason = "stop"
            return []
        self.frames += 1
        self.seen.add(row[0])
        self._last = row
        if self.frames >= self.max_frames:
            self._reason = "length"
        return [row]

    @property
    def last_column(self) -> Row:
        assert self._last is not None, "no frame yet"
        return self._last

    @property
    def finished(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason


class QwenFrameWriter:
    """Rows are frames already (engine/family.py FrameWriter); it checks they hold real codes. The
    fast path's last row of a stream stopped by EOS carries EOS in group 0: no frame (None)."""

    num_replaced = 0  # nothing to replace: group 0 is suppressed to codes or EOS

    def __init__(self, codebook_size: int, eos: int) -> None:
        self.codebook_size, self.eos = codebook_size, eos

    def push(self, row: Sequence[int], final: bool = False) -> list[int] | None:
        if int(row[0]) == self.eos:
            assert final, "an EOS row that does not end the stream"
            return None
        frame = [int(x) for x in row]
        assert all(0 <= x < self.codebook_size for x in frame), f"frame holds a non-code id: {frame}"
        return frame


class QwenPolicy:
    sample_at_prompt_end = True  # the prompt's last position yields frame 0's group 0
    head_codebooks = 1  # group 0 from the talker; groups 1..15 from the code predictor
    takes_history = False  # no prompt slot for earlier segments' audio: each segment keeps the voice by its request

    def __init__(self, cfg: QwenTTSConfig, tokenizer: TokenizerLike) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        special = getattr(tokenizer, "special", None)
        if special is not None and (special.im_start, special.im_end) != (cfg.im_start_id, cfg.im_end_id):
            raise ConfigError(f"the text tokenizer's <|im_start|>/<|im_end|> ids ({special.im_start}, "
                              f"{special.im_end}) differ from config.json's ({cfg.im_start_id}, {cfg.im_end_id})")
        self.control = {cfg.im_start_id, cfg.im_end_id, cfg.tts_pad_id, cfg.tts_bos_id, cfg.tts_eos_id}

    # ---- what a request may name ----
    @property
    def speakers(self) -> tuple[str, ...]:
        """The checkpoint's built-in voices, in config.json order (CustomVoice; empty otherwise)."""
        return tuple(self.cfg.speakers) if self.cfg.variant == "custom_voice" else ()

    @property
    def default_speaker(self) -> str | None:
        return self.speakers[0] if self.speakers else None

    @property
    def takes_instructions(self) -> bool:
        """VoiceDesign, and CustomVoice except 0.6B (the reference drops a 0.6B model's instruction)."""
        v = self.cfg.variant
        return v == "voice_design" or (v == "custom_voice" and self.cfg.size not in "0b6")

    # ---- the prompt ----
    def build_prompt(self, request: GenerationRequest) -> Prompt:
        return engine_prompt(self.cfg, self.qwen_prompt(request))

    def check_transcript(self, transcript: str) -> None:
        """InvalidInputError when `transcript` holds a control token: the check `qwen_prompt` runs on a Base
        reference's transcript."""
        self._chat(REFERENCE.format(transcript), "reference transcript", 2)

    def qwen_prompt(self, request: GenerationRequest) -> QwenPrompt:
        cfg, variant = self.cfg, self.cfg.variant
        if request.scene or request.system:
            raise InvalidInputError("Qwen3-TTS has no scene or system text; describe the voice with instructions")
        if request.history:
            raise InvalidInputError("Qwen3-TTS takes no history segments")
        speaker = request.speaker
        if speaker is not None and not self.speakers:
            raise InvalidInputError(f"this Qwen3-TTS {variant} checkpoint has no built-in speakers")
        if variant == "custom_voice" and speaker is None:
            speaker = self.default_speaker
        instruct = None
        if request.instructions:  # "" = none
            if not self.takes_instructions:
                raise InvalidInputError(f"this Qwen3-TTS {variant} checkpoint (size {cfg.size}) takes no instructions")
            instruct = self._chat(INSTRUCTION.format(request.instructions), "instructions", 2)
        ref = request.reference
        kwargs = {}
        if variant == "base":
            if ref is None:
                raise InvalidInputError("a Qwen3-TTS Base checkpoint clones a voice: give reference audio and its "
                                        "transcript (or, in Python, reference codes, transcript and speaker embedding)")
            if not ref.transcript or not ref.transcript.strip():
                raise InvalidInputError("a Qwen3-TTS Base reference needs the transcript of its audio "
                                        "(in-context cloning continues from it)")
            if ref.embedding is None or ref.embedding.shape != (cfg.hidden_size,):
                raise InvalidInputError(f"a Qwen3-TTS Base reference needs a speaker embedding of {cfg.hidden_size} "
                                        f"values, got {None if ref.embedding is None else ref.embedding.shape}")
            codes = ref.codes
            if codes.shape[0] != cfg.num_codebooks or codes.max() >= cfg.codebook_size:
                raise InvalidInputError(f"reference codes must be [{cfg.num_codebooks}, T] in 0..{cfg.codebook_size - 1}")
            kwargs = dict(speaker_vector=ref.embedding, ref_codes=codes.T,
                          ref_ids=self._chat(REFERENCE.format(ref.transcript), "reference transcript", 2))
        elif ref is not None:
            raise InvalidInputError(f"a Qwen3-TTS {variant} checkpoint takes no reference voice (Base clones voices)")
        stream_text = request.stream_text if request.stream_text is not None else variant == "base"
        text = self._chat(ASSISTANT.format(request.text), "text", 5)
        return build_prompt(cfg, text, language=request.language or "auto", speaker=speaker, instruct_ids=instruct,
                            non_streaming=not stream_text, **kwargs)

    def _chat(self, text: str, what: str, tail: int) -> list[int]:
        """Template ids; InvalidInputError when the user's part holds a control token."""
        ids = list(self.tokenizer.encode(text))
        body = ids[3:-tail]
        bad = sorted(set(body) & self.control)
        if bad:
            raise InvalidInputError(f"{what} contains control tokens (ids {bad}); remove them")
        return ids

    # ---- per stream ----
    def new_segment(self, prompt: Prompt, params: SamplingParams, max_frames: int) -> QwenSegment:
        return QwenSegment(self.cfg, max_frames)

    def new_writer(self) -> QwenFrameWriter:
        return QwenFrameWriter(self.cfg.codebook_size, self.cfg.codec_eos_id)

    def process_logits(self, logits: torch.Tensor, segments: Sequence[QwenSegment]) -> torch.Tensor:
        """Group 0's logits processors for every sampled row: logits [S, 1, V] fp32 -> [S, 1, V] (the
        batched `generate.group0_rules`)."""
        cfg = self.cfg
        s, _, v = logits.shape
        dev = logits.device
        g = logits[:, 0]  # [S, V]
        penalty = cfg.generation.repetition_penalty
        if penalty != 1.0 and any(seg.seen for seg in segments):
            seen = np.zeros((s, v), bool)
            for i, seg in enumerate(segments):
                seen[i, list(seg.seen)] = True
            g = torch.where(torch.from_numpy(seen).to(dev), torch.where(g < 0, g * penalty, g / penalty), g)
        special = torch.arange(v, device=dev) >= cfg.codebook_size  # [V]
        hold_eos = torch.tensor([seg.frames < MIN_FRAMES for seg in segments], device=dev)  # [S]
        is_eos = torch.arange(v, device=dev) == cfg.codec_eos_id
        suppress = special[None] & ~(is_eos[None] & ~hold_eos[:, None])  # [S, V]
        return g.masked_fill(suppress, float("-inf"))[:, None]


def engine_prompt(cfg: QwenTTSConfig, p: QwenPrompt) -> Prompt:
    """A QwenPrompt as the engine's family.Prompt: text track in `input_ids` (NO_ID: empty), codec ids,
    reference frames as audio rows, the speaker vector as a vector row, the trailing text as the
    decode steps' text track (then tts_pad)."""
    text = np.concatenate([p.text_ids[p.text_ids != NONE], p.trailing]).astype(np.int64)
    if text.size and int(text.max()) >= cfg.text_vocab_size:  # checked here: the fast path embeds on the device
        raise InvalidInputError(f"text ids must lie in [0, {cfg.text_vocab_size})")
    is_audio = p.frames[:, 0] != NONE
    codes = np.where(is_audio[:, None], p.frames, 0).astype(np.int64)  # [P, 16]
    has_vec = p.speaker_at >= 0
    return Prompt(input_ids=np.where(p.text_ids == NONE, NO_ID, p.text_ids).astype(np.int64), audio_codes=codes,
                  is_audio=is_audio, audio_out=np.ascontiguousarray(codes[is_audio].T),
                  codec_ids=np.where(p.codec_ids == NONE, NO_ID, p.codec_ids).astype(np.int64),
                  vector_rows=np.array([p.speaker_at] if has_vec else [], np.int64),
                  vectors=p.speaker[None].astype(np.float32) if has_vec else None,
                  text_track=p.trailing.astype(np.int64), text_pad=cfg.tts_pad_id)
