"""One ragged forward step: what the engine hands a talker and what it gets back.

`StepBatch` is the host batch of the plain-torch path (every family's talker implements
`forward(StepBatch, KVCache) -> StepOutput`, its heads run through `logits_at_rows`);
`DEFAULT_MAX_POSITIONS` is the serving context cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.talker_config import BackboneConfig

DEFAULT_MAX_POSITIONS = 8192  # context cap per sequence (Boson's serve engine caps at 8192)


@dataclass
class StepBatch:
    """One ragged forward over B sequences; host (CPU) tensors, moved to the model's device.

    Sequence b's qo_lens[b] tokens are rows sum(qo_lens[:b]) .. of the [N] tensors, and are the last
    qo_lens[b] tokens the KV cache has reserved for it.
    """

    seq_ids: list[int]
    qo_lens: list[int]
    input_ids: torch.Tensor  # [N] long, text ids (ignored at audio rows)
    audio_codes: torch.Tensor  # [N, num_codebooks] long, 0..audio_vocab-1 (ignored at text rows)
    is_audio: torch.Tensor  # [N] bool
    positions: torch.Tensor  # [N] long, RoPE positions
    want_text: torch.Tensor  # [B] bool, compute text logits for these sequences
    want_audio: torch.Tensor  # [B] bool, compute audio logits for these sequences
    # tracks only some families' prompts carry (family.Prompt); None when no row of the step has them
    codec_ids: torch.Tensor | None = None  # [N] long, one codec-vocabulary id per row, -1 where none
    vector_rows: torch.Tensor | None = None  # [V] long, rows (of the N) that add an input vector
    vectors: torch.Tensor | None = None  # [V, H] float32, those vectors

    def validate(self, cfg: BackboneConfig, max_positions: int) -> None:
        """Shape and value checks (positions in [0, max_positions)); InvalidInputError on the first violation."""
        b, n = len(self.seq_ids), sum(self.qo_lens)
        if b == 0 or len(self.qo_lens) != b or min(self.qo_lens) < 1:
            raise InvalidInputError(f"need >= 1 sequence with qo_len >= 1 each, got qo_lens={self.qo_lens}")
        if len(set(self.seq_ids)) != b:
            raise InvalidInputError(f"a sequence appears twice in one step: {self.seq_ids}")
        expect = {
            "input_ids": ((n,), torch.long), "audio_codes": ((n, cfg.num_codebooks), torch.long),
            "is_audio": ((n,), torch.bool), "positions": ((n,), torch.long),
            "want_text": ((b,), torch.bool), "want_audio": ((b,), torch.bool),
        }
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype or t.device.type != "cpu":
                raise InvalidInputError(
                    f"{name} must be a CPU {dtype} tensor {shape}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        text_ids = self.input_ids[~self.is_audio]
        if text_ids.numel() and (text_ids.min() < 0 or text_ids.max() >= cfg.vocab_size):
            raise InvalidInputError(f"text ids must lie in [0, {cfg.vocab_size})")
        codes = self.audio_codes[self.is_audio]
        if codes.numel() and (codes.min() < 0 or codes.max() >= cfg.audio_vocab):
            raise InvalidInputError(f"audio codes must lie in [0, {cfg.audio_vocab})")
        if self.positions.numel() and (self.positions.min() < 0 or self.positions.max() >= max_positions):
            raise InvalidInputError(f"positions must lie in [0, {max_positions}) (the context cap), "
                                    f"got {int(self.positions.min())}..{int(self.positions.max())}")


@dataclass
class StepOutput:
    audio_logits: torch.Tensor  # [B, head codebooks, audio_vocab] float32; NaN rows where not wanted
    text_logits: torch.Tensor | None  # [B, V] float32 (NaN rows where not wanted) or None if none wanted
    hidden: torch.Tensor | None = None  # [B, H] final-normed state at each sequence's last row, for a
    #                                     family that completes rows from it (family.RowCompleter)


def logits_at_rows(head: Callable[[torch.Tensor], torch.Tensor], last: torch.Tensor, want: torch.Tensor,
                   shape: tuple[int, ...]) -> torch.Tensor:
    """A head over the rows a step wants (`StepBatch.want_audio` / `want_text`): last [B, H] -> [B, *shape]
    float32, head(last[b]) where want[b] (host bool [B]), NaN elsewhere; the head runs on wanted rows only."""
    rows = want.nonzero().flatten().tolist()
    b = last.shape[0]
    if len(rows) == b:  # the usual decode step: every sequence wants it
        return head(last).float().view(b, *shape)
    out = torch.full((b, *shape), float("nan"), device=last.device)
    if rows:
        index = torch.tensor(rows, device=last.device)
        out[index] = head(last[index]).float().view(len(rows), *shape)
    return out
