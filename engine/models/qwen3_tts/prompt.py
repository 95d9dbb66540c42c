"""The Qwen3-TTS prompt for the three variants, as the official `generate` builds it (PyPI qwen-tts 0.1.1).

Every position is the sum of a text track and a codec track (either may be empty):

    [instruction: text only]                                  VoiceDesign / CustomVoice 1.7B
    <|im_start|> assistant \\n                               text only
    think / nothink, think_bos, [language], think_eos,        codec ids, with text tts_pad ... tts_bos
      [speaker], pad                                          (speaker: a codec id, or Base's x-vector)
    then, streaming text (one text id per decode step):
      text[0] + codec bos;  later steps feed text[1:], tts_eos, then tts_pad
    or non-streaming text (all text in the prompt):
      text[:] + codec pad, tts_eos + codec pad, tts_pad + codec bos;  decode steps feed tts_pad
    Base with reference codes (ICL): after the codec prefix, codec bos then the reference frames,
      aligned with the reference transcript + text + tts_eos (the text's excess, if any, trails).

The text ids are the chat template's: `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`,
the instruction `<|im_start|>user\\n{instruct}<|im_end|>\\n`, the reference `<|im_start|>assistant\\n{ref}<|im_end|>\\n`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.models.qwen3_tts.config import QwenTTSConfig

NONE = -1  # an empty track at a position


@dataclass(frozen=True)
class QwenPrompt:
    text_ids: np.ndarray  # [P] text ids, NONE where the text track is empty
    codec_ids: np.ndarray  # [P] codec ids, NONE where the codec track is empty or holds a frame/speaker
    frames: np.ndarray  # [P, 16] codes of whole frames (reference audio), NONE rows elsewhere
    speaker_at: int  # position of Base's speaker vector, or -1
    speaker: np.ndarray | None  # [H] float32 (Base) or None
    trailing: np.ndarray  # [T] text ids the decode steps feed, one per step (then tts_pad)

    def __len__(self) -> int:
        return int(self.text_ids.shape[0])


def check_chat_ids(ids: list[int], cfg: QwenTTSConfig, tail: bool, what: str) -> None:
    """The template's fixed ids around the text (a malformed one is a caller bug: say which)."""
    head_ok = len(ids) >= 3 and ids[0] == cfg.im_start_id
    tail_ok = (len(ids) >= 9 and ids[-5] == cfg.im_end_id and ids[-3] == cfg.im_start_id) if tail else \
        (len(ids) >= 5 and ids[-2] == cfg.im_end_id)
    if not (head_ok and tail_ok):
        raise InvalidInputError(f"{what} ids do not follow the chat template")


def build_prompt(cfg: QwenTTSConfig, text_ids: list[int], *, language: str = "auto", speaker: str | None = None,
                 instruct_ids: list[int] | None = None, non_streaming: bool = False,
                 speaker_vector: np.ndarray | None = None, ref_ids: list[int] | None = None,
                 ref_codes: np.ndarray | None = None) -> QwenPrompt:
    """The prompt positions for one request; InvalidInputError for an unknown speaker or language."""
    check_chat_ids(text_ids, cfg, tail=True, what="text")
    lang = language.lower()
    if lang != "auto" and lang not in cfg.languages:
        raise InvalidInputError(f"unknown language {language!r}; expected one of {list(cfg.public_languages)}")
    language_id = None if lang == "auto" else cfg.languages[lang]
    speaker_id = None
    if speaker:
        key = speaker.lower()
        if key not in cfg.speakers:
            raise InvalidInputError(f"unknown speaker {speaker!r}; this checkpoint has {sorted(cfg.speakers) or 'none'}")
        speaker_id = cfg.speakers[key]
        dialect = cfg.speaker_dialects.get(key, False)
        if lang in ("chinese", "auto") and dialect:
            language_id = cfg.languages[dialect]
    text, codec = [], []
    frames: dict[int, np.ndarray] = {}  # position -> its whole frame (reference audio); NONE rows elsewhere

    def put(t: int = NONE, c: int = NONE, f: np.ndarray | None = None) -> None:
        if f is not None:
            frames[len(text)] = f
        text.append(t)
        codec.append(c)

    for t in instruct_ids or []:
        put(t=t)
    for t in text_ids[:3]:
        put(t=t)
    prefix = ([cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id] if language_id is None else
              [cfg.codec_think_id, cfg.codec_think_bos_id, language_id, cfg.codec_think_eos_id])
    has_speaker = speaker_id is not None or speaker_vector is not None
    slots = prefix + [speaker_id if speaker_id is not None else NONE] * has_speaker + [cfg.codec_pad_id]
    speaker_at = -1
    for i, c in enumerate(slots):
        t = cfg.tts_bos_id if i == len(slots) - 1 else cfg.tts_pad_id
        if has_speaker and i == len(prefix) and speaker_vector is not None:
            speaker_at = len(text)
        put(t=t, c=c)
    body = list(text_ids[3:-5])
    if ref_codes is not None:  # Base, ICL
        if ref_ids is None:
            raise InvalidInputError("reference codes need the reference transcript")
        check_chat_ids(ref_ids, cfg, tail=False, what="reference transcript")
        seq = list(ref_ids[3:-2]) + body + [cfg.tts_eos_id]
        refs = np.asarray(ref_codes, dtype=np.int64)  # [F, 16]
        codec_seq = [(cfg.codec_bos_id, None)] + [(NONE, row) for row in refs]
        if non_streaming:
            for t in seq:
                put(t=t, c=cfg.codec_pad_id)
            for c, f in codec_seq:
                put(t=cfg.tts_pad_id, c=c, f=f)
            trailing: list[int] = []
        else:
            for i, (c, f) in enumerate(codec_seq):
                put(t=seq[i] if i < len(seq) else cfg.tts_pad_id, c=c, f=f)
            trailing = seq[len(codec_seq):]
    elif non_streaming:
        for t in body + [cfg.tts_eos_id]:
            put(t=t, c=cfg.codec_pad_id)
        put(t=cfg.tts_pad_id, c=cfg.codec_bos_id)
        trailing = []
    else:
        put(t=text_ids[3], c=cfg.codec_bos_id)
        trailing = list(text_ids[4:-5]) + [cfg.tts_eos_id]
    rows = np.full((len(text), cfg.num_codebooks), NONE, np.int64)
    for at, f in frames.items():
        rows[at] = f
    return QwenPrompt(text_ids=np.array(text, np.int64), codec_ids=np.array(codec, np.int64),
                      frames=rows, speaker_at=speaker_at,
                      speaker=None if speaker_vector is None else np.asarray(speaker_vector, np.float32),
                      trailing=np.array(trailing, np.int64))


def embed_prompt(model, prompt: QwenPrompt) -> torch.Tensor:
    """The prompt's input embeddings [P, H] (text track + codec track) on the model's device."""
    dev = model.device
    text = torch.from_numpy(prompt.text_ids).to(dev)
    codec = torch.from_numpy(prompt.codec_ids).to(dev)
    frames = torch.from_numpy(prompt.frames).to(dev)
    has_text, has_codec, has_frame = text >= 0, codec >= 0, frames[:, 0] >= 0
    x = torch.where(has_text[:, None], model.text_embed(text.clamp(min=0)), 0.0)
    x = x + torch.where(has_codec[:, None], model.codec_embed(codec.clamp(min=0)), 0.0)
    x = x + torch.where(has_frame[:, None], model.frame_embed(frames.clamp(min=0)), 0.0)
    if prompt.speaker_at >= 0:
        x[prompt.speaker_at] += torch.from_numpy(prompt.speaker).to(dev, x.dtype)
    return x
