"""What a caller asks the engine for: text to speak, an optional voice reference, sampling knobs.

All three are frozen dataclasses validated when built; bad values raise InvalidInputError.
Defaults follow Boson's serve engine (research/higgs_v2_reference.md §3.7): temperature 0.7,
no top-k, top-p 0.95, RAS window 7 with at most 2 repeats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from higgs_stream.engine.errors import InvalidInputError

# 2000 frames = 80 s at 25 frames/s; REF's CLI stops at max_new_tokens=2048 columns (~81.5 s).
DEFAULT_MAX_FRAMES = 2000


GREEDY_BELOW = 1e-6  # temperatures below it sample greedily (logits / 1e-6 stay finite in fp32)


@dataclass(frozen=True)
class SamplingParams:
    """Per-codebook sampling of audio columns.

    temperature 0 means greedy (argmax); RAS (repetition-aware sampling) still applies then, as in
    REF. ras_window 0 switches RAS off. seed None: the engine draws a fresh seed per request. A temperature below
    GREEDY_BELOW is greedy too (the limit of sampling as it goes to 0): in fp32, 1e-45 is 0 and the logits / 0 are
    NaN probabilities, whose draw was noise (found by a probe).
    """

    temperature: float = 0.7
    top_k: int | None = None
    top_p: float = 0.95
    ras_window: int = 7
    ras_max_repeat: int = 2
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidInputError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise InvalidInputError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.ras_window) or self.ras_window < 0:
            raise InvalidInputError(f"ras_window must be an int >= 0 (0 = off), got {self.ras_window!r}")
        if not _is_int(self.ras_max_repeat) or self.ras_max_repeat < 1:
            raise InvalidInputError(f"ras_max_repeat must be an int >= 1, got {self.ras_max_repeat!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidInputError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class Reference:
    """A voice sample as codec codes [num_codebooks, T] (0..codebook_size-1) plus its transcript,
    and for a model that conditions on one (Qwen3-TTS Base) the sample's speaker embedding.

    Also the type of one long-form history segment (earlier text and the codes spoken for it).
    The codes (and the embedding) are copied into read-only arrays.
    """

    codes: np.ndarray
    transcript: str
    embedding: np.ndarray | None = None  # [H] float32 speaker embedding (x-vector), or None

    def __post_init__(self) -> None:
        if self.embedding is not None:
            emb = np.asarray(self.embedding)
            if emb.ndim != 1 or emb.shape[0] < 1 or not np.issubdtype(emb.dtype, np.number) \
                    or not np.isfinite(emb).all():
                raise InvalidInputError(f"a reference embedding must be a finite 1-D vector, got shape {emb.shape}")
            emb = np.array(emb, dtype=np.float32, copy=True)
            emb.setflags(write=False)
            object.__setattr__(self, "embedding", emb)
        codes = np.asarray(self.codes)
        if codes.ndim != 2 or codes.shape[1] < 1:
            raise InvalidInputError(f"reference codes must be [num_codebooks, T>=1], got shape {codes.shape}")
        if not np.issubdtype(codes.dtype, np.integer):
            raise InvalidInputError(f"reference codes must be integers, got dtype {codes.dtype}")
        if codes.min() < 0:
            raise InvalidInputError(f"reference codes must be >= 0, got min {codes.min()}")
        codes = np.array(codes, dtype=np.int64, copy=True)
        codes.setflags(write=False)
        object.__setattr__(self, "codes", codes)
        _check_text("reference transcript", self.transcript)

    @property
    def num_frames(self) -> int:
        return int(self.codes.shape[1])


@dataclass(frozen=True)
class GenerationRequest:
    """One utterance to generate.

    scene: None = REF's default scene ("Audio is recorded from a quiet room."), "" = no scene.
    system: None = "Generate audio following instruction.", else that system text.
    history: earlier segments of the same long-form context, as Reference objects or
    (text, codes) pairs; they go after the reference turns, oldest first.
    max_frames: hard cap on generated frames; on reaching it the stream ends cleanly with
    reason "length" (the engine may lower it further to fit its context length).

    What only some model families take (a family refuses, with InvalidInputError, what it cannot
    express): speaker: one of the checkpoint's built-in voices (Qwen3-TTS CustomVoice);
    instructions: a natural-language description of voice and style (Qwen3-TTS VoiceDesign and
    1.7B CustomVoice; Higgs v2 takes it as its scene description); language: a language the
    checkpoint names, None = automatic; stream_text: feed the text one id per decode step (True)
    or put it all in the prompt (False), None = the checkpoint's default (Qwen3-TTS).
    """

    text: str
    reference: Reference | None = None
    scene: str | None = None
    system: str | None = None
    history: tuple[Reference, ...] = field(default=())
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_frames: int = DEFAULT_MAX_FRAMES
    speaker: str | None = None
    instructions: str | None = None
    language: str | None = None
    stream_text: bool | None = None

    def __post_init__(self) -> None:
        _check_text("text", self.text)
        if self.reference is not None and not isinstance(self.reference, Reference):
            raise InvalidInputError(f"reference must be a Reference, got {type(self.reference).__name__}")
        if self.scene is not None and not isinstance(self.scene, str):
            raise InvalidInputError(f"scene must be a string or None, got {type(self.scene).__name__}")
        if self.scene is not None:
            _check_unicode("scene", self.scene)
        if self.system is not None:
            _check_text("system", self.system)
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidInputError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        if not _is_int(self.max_frames) or self.max_frames < 1:
            raise InvalidInputError(f"max_frames must be an int >= 1, got {self.max_frames!r}")
        for name in ("speaker", "language"):
            if getattr(self, name) is not None:
                _check_text(name, getattr(self, name))
        if self.instructions is not None:  # "" = no instructions
            if not isinstance(self.instructions, str):
                raise InvalidInputError(f"instructions must be a string or None, got {type(self.instructions).__name__}")
            _check_unicode("instructions", self.instructions)
        if self.stream_text is not None and not isinstance(self.stream_text, bool):
            raise InvalidInputError(f"stream_text must be True, False or None, got {self.stream_text!r}")
        object.__setattr__(self, "history", tuple(_as_segment(h) for h in self.history))

    @property
    def audio_segments(self) -> tuple[Reference, ...]:
        """Every piece of prompt audio: the reference (if any), then the history, oldest first."""
        return ((self.reference,) if self.reference is not None else ()) + self.history

    def check_codes(self, num_codebooks: int, codebook_size: int) -> None:
        """InvalidInputError unless every audio segment's codes are [num_codebooks, T] in
        0..codebook_size-1 (a model's own codebooks; the dataclasses check only shape and sign)."""
        for i, seg in enumerate(self.audio_segments):
            what = "reference" if i == 0 and self.reference is not None else "history"
            if seg.codes.shape[0] != num_codebooks:
                raise InvalidInputError(f"{what} codes must have {num_codebooks} codebooks, got {seg.codes.shape[0]}")
            if seg.codes.max() >= codebook_size:
                raise InvalidInputError(f"{what} codes must lie in 0..{codebook_size - 1}, got max {seg.codes.max()}")


def refuse_fields(request: GenerationRequest, names: tuple[str, ...], model: str) -> None:
    """InvalidInputError naming the first of `names` the request sets (a field `model` cannot express);
    "embedding" stands for a reference's speaker embedding."""
    for name in names:
        given = (any(r.embedding is not None for r in (request.reference, *request.history) if r is not None)
                 if name == "embedding" else getattr(request, name) is not None)
        if given:
            what = "a reference speaker embedding" if name == "embedding" else name
            raise InvalidInputError(f"{model} takes no {what}")


def _as_segment(item: Reference | tuple[str, np.ndarray]) -> Reference:
    if isinstance(item, Reference):
        return item
    if isinstance(item, tuple) and len(item) == 2:
        text, codes = item
        return Reference(codes=codes, transcript=text)
    raise InvalidInputError(f"history items must be Reference or (text, codes) pairs, got {type(item).__name__}")


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidInputError(f"{name} must not be empty")
    _check_unicode(name, value)


def _check_unicode(name: str, value: str) -> None:
    """The tokenizer takes valid Unicode only: a lone surrogate ("\\ud800", legal in JSON) is refused."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"{name} is not valid Unicode: {e.reason} at index {e.start}") from e


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and np.isfinite(x)
