"""The contract every model family implements; the engine, loader, CLI and benchmarks see only this.

A family is one package under `engine/models/<name>/` (config, checkpoint layout, talker, prompt,
generation policy, device rules, frame writer, checkpoint writer); its package exports one entry
object, `FAMILY`, that implements `ModelFamily`. `models/registry.py` chooses the family by the
checkpoint's config.json `model_type`. Nothing outside `engine/models/` imports a family package.

    ModelFamily                     loading, codec, random weights, checkpoint writing
      .policy(cfg, tokenizer)  ->   GenerationPolicy: prompt, the per-stream host rule machine
                                    (`Segment`, the test oracle of the device rules) and the
                                    per-stream `FrameWriter` (codes rows -> codec frames)
      .device_rules(cfg)       ->   DeviceRules: the same rules on the device (engine/gpu_sampling.py)

What the families share with the engine is data: a `Prompt` (positions of text ids and audio
codes) in, codec frames [num_codebooks] out (`StepEvent.frame`). A row of codes is what one
talker step emits (Higgs: one delay-pattern column; Qwen3-TTS: one whole frame); how rows become
codec frames is the family's `FrameWriter`, so the stream side sees frames only, laid out as the
codec declares (engine/codec/geometry.py).

A decode step feeds back a stream's last row on the codec track and, on the text track, the next
id of its prompt's `text_track` (then `text_pad` for ever): the Higgs families feed their
continuation token every step; Qwen3-TTS streams the rest of the text one id per step.

A family whose talker head samples only the first `head_codebooks` codebooks of a row has the
rest written per step by its talker's `complete_rows` (Qwen3-TTS's code predictor: groups 1..15
from the talker's hidden state and group 0), batched over every stream of the step; its
`process_logits` runs the family's logits processors on the head's logits before sampling. On the
fast path (engine/fast_talker.py `FastWeights`) the talker packs its own row embedding
(`embed_rows`) and a row completion with the `complete_rows` signature built on the fast path's
kernels (`FastWeights.complete_rows`; Qwen3-TTS: models/qwen3_tts/fast_predictor.py), which runs
inside the graphed step with a device `pick` (gpu_sampling.DeviceStreamState); the processors run
as `DeviceRules.process`. A row that ends a stream may carry a stop id instead of codes
(Qwen3-TTS: EOS in group 0): its writer returns None for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from higgs_stream.engine.request import GenerationRequest, SamplingParams

Row = tuple[int, ...]  # the codes one talker step emits for one stream (K ids, family-defined range)
Pick = Callable[[int, torch.Tensor], torch.Tensor]  # (codebook, logits [S, V] fp32) -> sampled ids [S]
NO_ID = -1  # an empty track at a position (Prompt.input_ids, Prompt.codec_ids)


def _no_ids() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclass(frozen=True)
class Prompt:
    """The positions of one prompt; row i is RoPE position i. How a row's tracks combine into its
    input is the family talker's (Higgs: an audio row's codes replace its text; Qwen3-TTS: the
    tracks are summed)."""

    input_ids: np.ndarray  # [P] int64 text ids (a family placeholder at Higgs audio rows; NO_ID: empty)
    audio_codes: np.ndarray  # [P, K] int64 audio codes at audio rows, 0 elsewhere
    is_audio: np.ndarray  # [P] bool: the row's codec track is a whole row of codes
    audio_out: np.ndarray  # [K, A] int64 every audio row of the prompt, in order (e.g. the RAS window)
    codec_ids: np.ndarray | None = None  # [P] int64 one codec-vocabulary id per row (NO_ID: none), or None
    vector_rows: np.ndarray = field(default_factory=_no_ids)  # [V] int64 rows that add an input vector
    vectors: np.ndarray | None = None  # [V, H] float32 those vectors (e.g. a speaker embedding)
    text_track: np.ndarray = field(default_factory=_no_ids)  # [T] int64 text ids decode steps feed, one each
    text_pad: int = NO_ID  # the text id every decode step after the track feeds

    def __post_init__(self) -> None:
        p = self.input_ids.shape[0]
        assert self.audio_codes.shape[0] == p and self.is_audio.shape == (p,), "prompt arrays disagree in length"
        assert int(self.is_audio.sum()) == self.audio_out.shape[1], "audio rows != audio-out columns"
        assert self.codec_ids is None or self.codec_ids.shape == (p,), "codec_ids disagree in length"
        n = self.vector_rows.shape[0]
        assert (self.vectors is None) == (n == 0) and (n == 0 or self.vectors.shape[0] == n), "vectors != vector rows"
        assert n == 0 or (0 <= self.vector_rows.min() and self.vector_rows.max() < p), "vector rows outside the prompt"

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def step_text_id(self, step: int) -> int:
        """The text id decode step `step` (0: the first decode step after the prompt) feeds."""
        return int(self.text_track[step]) if step < self.text_track.shape[0] else self.text_pad


class TokenizerLike(Protocol):
    special: Any  # the family's special-token ids

    def encode(self, text: str) -> list[int]: ...


class Segment(Protocol):
    """One stream's host rule machine; each call returns the rows to emit, in order (a forced start
    row is the writer's to know, not emitted)."""

    k: int  # codes per row

    def start(self) -> list[Row]: ...  # at the prompt's last chunk (before any sampled row)

    def advance(self, sampled: Sequence[int], ras_candidate: Sequence[int]) -> list[Row]: ...

    @property
    def finished(self) -> bool: ...

    @property
    def reason(self) -> str | None: ...  # "stop" | "length" once finished

    @property
    def last_column(self) -> Row: ...  # what the next decode step feeds back


class FrameWriter(Protocol):
    """One stream's rows -> codec frames (Higgs: the delay-pattern revert). Every frame it returns
    holds real codes only (0..codebook_size-1), so the stream side never sees a model constant."""

    num_replaced: int  # stray ids replaced so far

    def push(self, row: Sequence[int], final: bool = False) -> list[int] | None:
        """One emitted row (`final`: the stream's last, ended by stop or length) -> the codec frame
        [num_codebooks] it completes, or None."""
        ...


class GenerationPolicy(Protocol):
    """What differs between model families in the engine's loop, per stream."""

    sample_at_prompt_end: bool  # the prompt's last position yields a sampled row (else a forced start row)
    head_codebooks: int  # codebooks of a row the talker's head samples; the rest: talker.complete_rows
    takes_history: bool  # a request may carry earlier segments' audio (GenerationRequest.history)
    speakers: tuple[str, ...]  # the checkpoint's built-in voices (GenerationRequest.speaker); () if none

    def build_prompt(self, request: GenerationRequest) -> Prompt: ...

    def check_transcript(self, transcript: str) -> None: ...  # InvalidInputError: a control token that
    # `build_prompt` refuses in a reference's transcript

    def process_logits(self, logits: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """The family's logits processors before sampling: head logits [S, head_codebooks, V] fp32 of
        the step's sampled rows and their streams' segments -> processed logits, same shape
        (identity for the Higgs families; Qwen3-TTS: special ids suppressed, EOS held off for the
        first frames, repetition penalty)."""
        ...

    def new_segment(self, prompt: Prompt, params: SamplingParams, max_frames: int) -> Segment: ...

    def new_writer(self) -> FrameWriter: ...  # what the engine runs over a stream's emitted rows


class RowCompleter(Protocol):
    """The talker of a family whose head samples only the first codebooks of a row."""

    def complete_rows(self, hidden: torch.Tensor, head: torch.Tensor, pick: Pick) -> torch.Tensor:
        """hidden [S, H] (the talker's final-normed state at each sampled row, `StepOutput.hidden`),
        head [S, head_codebooks] sampled ids -> whole rows [S, K] int64; `pick(codebook, logits)`
        samples each further codebook (every stream with its own generator and parameters)."""
        ...


class DeviceRules(Protocol):
    """A family's row rules on the device, applied by `DeviceStreamState.sample_and_advance` to the
    sampled tokens of every row (graph-capturable: fixed shapes, no host synchronisation).
    `gpu_sampling.RowRules` gives the optional hooks' defaults (attach, start, process)."""

    uses_ras: bool  # whether rows take RAS (the state's window is seeded only then)
    # optional: `fusible = True` with an integer-only `rows(state, tokens, candidate, slots, live, finite)` that
    # `advance` ends in, which `gpu_sampling.RowRules.fuse` compiles (ModelRunnerConfig.fuse_rules; Higgs v2 / v3)

    def attach(self, state: Any) -> None: ...  # allocate the rules' own per-slot tensors (once)

    def start(self, state: Any, slots: torch.Tensor) -> None: ...  # reset them for streams that start (captured
    # in a CUDA graph: device tensors and scalar fills only, no host tensor)

    def process(self, state: Any, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The head's logits [B, h, V] fp32 -> processed (the device form of `policy.process_logits`)."""
        ...

    def cap(self, max_frames: int) -> int: ...  # the state's `cap_column` for a stream of max_frames

    def start_row(self, num_codebooks: int, codebook_size: int) -> Row:
        """A stream's row before its first sample: what the state feeds back and seeds the RAS
        window with at the prompt's end (Higgs: the all-BOS AUDIO_INIT column)."""
        ...

    def advance(self, state: Any, tokens: torch.Tensor, clean: torch.Tensor, noise: torch.Tensor,
                slots: torch.Tensor, live: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """Sampled tokens [B, K] (+ finite logits [B, K, V] and the step's noise [B, 2, K, V]) ->
        packed [B, K + 1]: the emitted row, then a status (gpu_sampling.RUNNING/STOP/LENGTH/ERROR/
        IGNORED); writes the rows' state back into `state`."""
        ...


class ModelFamily(Protocol):
    """A model family's entry object (`models/<name>/__init__.py: FAMILY`)."""

    name: str  # its package under engine/models/
    arch: str  # the CLI's --arch name
    model_types: tuple[str, ...]  # config.json model_type values it reads
    config_type: type  # its talker config class
    layouts: tuple[str, ...]  # on-disk layouts `make_checkpoint` writes; the first is the default
    # optional: `presets: tuple[str, ...]`, the presets `make_checkpoint` takes (default ("tiny", "full"));
    # `decode_pdl: bool`, whether its decode graphs take programmatic dependent launch by default (default True;
    # model_runner.default_pdl_max_rows)

    def load(self, root: Path, device: str | torch.device, dtype: torch.dtype | None,
             max_positions: int) -> tuple[torch.nn.Module, Any, Any]:
        """(talker, config with special ids, tokenizer) from a checkpoint directory; dtype None: as stored.

        The talker (an nn.Module) provides `forward(StepBatch, KVCache) -> StepOutput`, `fast_weights()`
        (the fast path's packing), `backbone_linears()` (the linears `--quantize` may quantize, by
        module name: engine/quantize.py), `cfg`, `dtype` and `audio_head_weight`; a family whose
        policy's `head_codebooks` < K also `complete_rows` (`RowCompleter`)."""
        ...

    def load_codec(self, root: Path, codec: str | Path | None, device: str | torch.device) -> Any:
        """The codec that decodes this checkpoint's codes (fp32); `codec`: an explicit one, if allowed."""
        ...

    def policy(self, cfg: Any, tokenizer: TokenizerLike) -> GenerationPolicy: ...

    def device_rules(self, cfg: Any) -> DeviceRules: ...

    def make_checkpoint(self, out: str | Path, preset: str, layout: str, seed: int) -> Path:
        """Write a random-weight checkpoint in the family's real on-disk layout."""
        ...

    def random_talker(self, preset: str, device: str | torch.device, dtype: torch.dtype, max_positions: int,
                      seed: int) -> tuple[torch.nn.Module, Any, Any]:
        """(talker, config, tokenizer) with seeded random weights drawn in memory (noise, never speech)."""
        ...
