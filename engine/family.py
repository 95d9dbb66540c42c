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
talker step emits (Higgs: one delay-pattern column); how rows become codec frames is the family's
`FrameWriter`, so the stream side sees frames only, laid out as the codec declares
(engine/codec/geometry.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from higgs_stream.engine.request import GenerationRequest, SamplingParams

Row = tuple[int, ...]  # the codes one talker step emits for one stream (K ids, family-defined range)


@dataclass(frozen=True)
class Prompt:
    """The positions of one prompt; row i is RoPE position i."""

    input_ids: np.ndarray  # [P] int64 text ids (a family placeholder at audio rows)
    audio_codes: np.ndarray  # [P, K] int64 audio codes at audio rows, 0 elsewhere
    is_audio: np.ndarray  # [P] bool
    audio_out: np.ndarray  # [K, A] int64 every audio row of the prompt, in order (e.g. the RAS window)

    def __post_init__(self) -> None:
        p = self.input_ids.shape[0]
        assert self.audio_codes.shape[0] == p and self.is_audio.shape == (p,), "prompt arrays disagree in length"
        assert int(self.is_audio.sum()) == self.audio_out.shape[1], "audio rows != audio-out columns"

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


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

    @property
    def continuation_id(self) -> int: ...  # text id of a decode step's input position

    def build_prompt(self, request: GenerationRequest) -> Prompt: ...

    def new_segment(self, prompt: Prompt, params: SamplingParams, max_frames: int) -> Segment: ...

    def new_writer(self) -> FrameWriter: ...  # what the engine runs over a stream's emitted rows


class DeviceRules(Protocol):
    """A family's row rules on the device, applied by `DeviceStreamState.sample_and_advance` to the
    sampled tokens of every row (graph-capturable: fixed shapes, no host synchronisation)."""

    uses_ras: bool  # whether rows take RAS (the state's window is seeded only then)

    def cap(self, max_frames: int) -> int: ...  # the state's `cap_column` for a stream of max_frames

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
    # optional: `presets: tuple[str, ...]`, the presets `make_checkpoint` takes (default ("tiny", "full"))

    def load(self, root: Path, device: str | torch.device, dtype: torch.dtype | None,
             max_positions: int) -> tuple[torch.nn.Module, Any, Any]:
        """(talker, config with special ids, tokenizer) from a checkpoint directory; dtype None: as stored.

        The talker (an nn.Module) provides `forward(StepBatch, KVCache) -> StepOutput`, `fast_weights()`
        (the fast path's packing), `backbone_linears()` (the linears `--quantize` may quantize, by
        module name: engine/quantize.py), `cfg`, `dtype` and `audio_head_weight`."""
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
