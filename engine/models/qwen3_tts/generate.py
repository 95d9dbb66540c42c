"""One stream's frames from the plain-torch model (the reference loop the engine's batched step is
tested against, and offline use): prefill, then per frame the talker step that yields group 0 and
the code predictor that writes groups 1..15; the frame's summed embedding plus the next text-track
id is the next talker input.

Group 0 follows the reference's `generate` rules: ids >= codebook_size are suppressed except EOS;
EOS is suppressed for the first `min_frames` steps; a repetition penalty (HF semantics: divide a
positive logit, multiply a negative one) applies to group-0 ids already generated. EOS ends the
stream without a frame.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.models.qwen3_tts.prompt import QwenPrompt, embed_prompt
from higgs_stream.engine.models.qwen3_tts.talker import QwenTTSModel

MIN_FRAMES = 2  # the reference's min_new_tokens


def group0_rules(logits: torch.Tensor, cfg, generated: list[int], penalty: float, step: int) -> torch.Tensor:
    """The reference's logits processors for group 0: logits [V] fp32 -> processed logits [V]."""
    out = logits.clone()
    if penalty != 1.0 and generated:
        ids = torch.tensor(sorted(set(generated)), device=out.device)
        picked = out[ids]
        out[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
    special = torch.arange(out.shape[0], device=out.device) >= cfg.codebook_size
    special[cfg.codec_eos_id] = step < MIN_FRAMES
    return out.masked_fill(special, float("-inf"))


@dataclass
class Trace:
    """What a reference run saw (parity tests): per step the raw group-0 logits and the predictor's."""

    prefill_logits: torch.Tensor | None = None  # [P, V] every prompt position
    step_logits: list[torch.Tensor] = field(default_factory=list)  # [V] per talker step
    predictor_logits: list[list[torch.Tensor]] = field(default_factory=list)  # per frame, 15 x [V]


def generate_frames(model: QwenTTSModel, prompt: QwenPrompt, max_frames: int,
                    pick0: Callable[[torch.Tensor], int] | None = None,
                    pick: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                    penalty: float = 1.0, trace: Trace | None = None) -> np.ndarray:
    """Frames [F, 16] int64 (greedy unless `pick0` / `pick` sample); stops at EOS or max_frames."""
    cfg = model.cfg
    pick0 = pick0 or (lambda lg: int(lg.argmax()))
    pick = pick or (lambda _g, lg: lg.argmax(dim=-1))
    p = len(prompt)
    cache = KVCache.create(cfg, num_pages=(p + max_frames) // 16 + 2, page_size=16, dtype=model.dtype,
                           device=model.device)
    cache.allocator.reserve(0, p)
    with torch.no_grad():
        hidden, _ = model.hidden(embed_prompt(model, prompt), torch.arange(p), cache, [0], [p])  # [P, H]
        if trace is not None:
            trace.prefill_logits = model.group0_logits(hidden)
        last = hidden[-1]
        pad = model.text_embed(torch.tensor([cfg.tts_pad_id], device=model.device))[0]
        frames: list[np.ndarray] = []
        generated: list[int] = []
        for step in range(max_frames):
            raw = model.group0_logits(last[None])[0]
            if trace is not None:
                trace.step_logits.append(raw)
            first = pick0(group0_rules(raw, cfg, generated, penalty, step))
            if first == cfg.codec_eos_id:
                break
            generated.append(first)
            frame, plog = model.complete_frames(last[None], torch.tensor([first], device=model.device), pick)
            if trace is not None:
                trace.predictor_logits.append([lg[0] for lg in plog])
            frames.append(frame[0].cpu().numpy())
            if step == max_frames - 1:
                break
            x = model.frame_embed(frame)[0]
            x = x + (model.text_embed(torch.tensor([int(prompt.trailing[step])], device=model.device))[0]
                     if step < len(prompt.trailing) else pad)
            cache.allocator.reserve(0, p + step + 1)
            h, _ = model.hidden(x[None], torch.tensor([p + step]), cache, [0], [1])
            last = h[-1]
    return np.stack(frames) if frames else np.zeros((0, cfg.num_codebooks), np.int64)
