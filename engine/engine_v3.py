"""Interim driver of v3 streams on the v2 `Engine` loop (until the Engine grows a policy seam).

The step loop, scheduler, KV bookkeeping, sampling and failure isolation are the v2 Engine's.
What differs for v3 is exactly the per-model "generation policy" (generation_v3.V3Policy):

1. the prompt builder and the per-stream segment (`policy.build_prompt`, `policy.new_segment`);
2. the decode step's input: `policy.continuation_id` (`<|audio|>`) with the previous row as codes;
3. `policy.sample_at_prompt_end`: the prompt's last chunk also wants audio logits and samples
   row 0 (v2's last prompt chunk only yields the forced BOS column);
4. a segment call may return several columns (v3: [BOS column, row 0] at the prompt end,
   [last row, EOC column] at the end); one StepEvent per column, `finished` on the last.

The overrides below are those four differences and nothing else; once `Engine` asks a policy
object for them (v2's policy being today's behaviour), this module reduces to `from_pretrained`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from higgs_stream.engine.config_v3 import TalkerV3Config
from higgs_stream.engine.engine import Engine, EngineConfig, StepEvent
from higgs_stream.engine.errors import CapacityError, InvalidInputError
from higgs_stream.engine.generation import Stream, make_generator, resolve_seed
from higgs_stream.engine.generation_v3 import V3Policy
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.sampling import SamplingTensors, sample_columns
from higgs_stream.engine.scheduler import Chunk
from higgs_stream.engine.talker import StepBatch

log = logging.getLogger(__name__)


class EngineV3(Engine):
    def __init__(self, talker: torch.nn.Module, cfg: TalkerV3Config, tokenizer, cache: KVCache,
                 config: EngineConfig | None = None) -> None:
        self.policy = V3Policy(cfg, tokenizer)
        super().__init__(talker, cfg, tokenizer, cache, config)

    @classmethod
    def from_pretrained(cls, model: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                        config: EngineConfig | None = None) -> EngineV3:
        from higgs_stream.engine.checkpoint_v3 import load_talker_v3

        config = config or EngineConfig()
        talker, cfg, tokenizer = load_talker_v3(model, device=device, dtype=dtype)
        kv_dtype = next(talker.body.parameters()).dtype
        cache = KVCache.create(cfg, num_pages=config.kv_pages, page_size=config.page_size, dtype=kv_dtype, device=device)
        return cls(talker, cfg, tokenizer, cache, config)

    # 1. prompt + segment from the policy
    def add(self, request: GenerationRequest) -> int:
        if not isinstance(request, GenerationRequest):
            raise InvalidInputError(f"expected a GenerationRequest, got {type(request).__name__}")
        prompt = self.policy.build_prompt(request)
        room = self.max_seq_len - len(prompt) - self.cfg.num_codebooks  # frames that fit the context length
        if room < 1:
            raise InvalidInputError(f"prompt takes {len(prompt)} positions; the context length is {self.max_seq_len}")
        if len(self._pending) + self.scheduler.num_waiting >= self.config.max_waiting:
            raise CapacityError(f"too many streams waiting (max_waiting={self.config.max_waiting})")
        params = resolve_seed(request.sampling)
        max_frames = min(request.max_frames, room)
        stream = Stream(sid=next(self._ids), request=request, prompt=prompt, params=params, max_frames=max_frames,
                        generator=make_generator(params.seed, self.device),
                        segment=self.policy.new_segment(max_frames))  # type: ignore[arg-type]
        pages = self.scheduler.config.pages_for(stream.max_kv_tokens)
        if pages > self.scheduler.config.num_pages:
            raise CapacityError(f"stream may need {pages} KV pages, the cache has {self.scheduler.config.num_pages}")
        self._pending.append(stream)
        return stream.sid

    def _wants_audio(self, c: Chunk) -> bool:
        return not c.prefill or (c.last_of_prompt and self.policy.sample_at_prompt_end)

    # 2. + 3. decode input and which rows want audio logits
    def _prepare_inputs(self, plan: list[Chunk]) -> StepBatch:
        k = self.cfg.num_codebooks
        ids, codes, is_audio, positions = [], [], [], []
        for c in plan:
            s = self._streams[c.sid]
            self.cache.allocator.reserve(c.sid, c.end)
            self._holds_pages.add(c.sid)
            if c.prefill:
                p = s.prompt
                ids.append(p.input_ids[c.start:c.end])
                codes.append(p.audio_codes[c.start:c.end])
                is_audio.append(p.is_audio[c.start:c.end])
            else:  # <|audio|> carrying the previous row
                ids.append(np.array([self.policy.continuation_id], np.int64))
                codes.append(np.array(s.segment.last_column, np.int64).reshape(1, k))
                is_audio.append(np.ones(1, bool))
            positions.append(np.arange(c.start, c.end, dtype=np.int64))
        return StepBatch(
            seq_ids=[c.sid for c in plan], qo_lens=[c.num_tokens for c in plan],
            input_ids=torch.from_numpy(np.concatenate(ids)), audio_codes=torch.from_numpy(np.concatenate(codes)),
            is_audio=torch.from_numpy(np.concatenate(is_audio)), positions=torch.from_numpy(np.concatenate(positions)),
            want_text=torch.zeros(len(plan), dtype=torch.bool),  # the text head never runs on v3 audio steps
            want_audio=torch.tensor([self._wants_audio(c) for c in plan], dtype=torch.bool),
        )

    def _sample(self, plan: list[Chunk], out) -> np.ndarray:
        rows = [i for i, c in enumerate(plan) if self._wants_audio(c)]
        if not rows:
            return np.zeros((0, 2 * self.cfg.num_codebooks + 1), np.int64)
        streams = [self._streams[plan[i].sid] for i in rows]
        logits = out.audio_logits[torch.tensor(rows, device=out.audio_logits.device)]  # [S, K, V]
        st = SamplingTensors.build([s.params for s in streams], self.cfg.audio_vocab, logits.device)
        draws = sample_columns(logits, st, [s.generator for s in streams])  # [S, 2, K]
        finite = torch.isfinite(logits).all(dim=2).all(dim=1)  # [S]
        return torch.cat([draws.flatten(1), finite[:, None].long()], dim=1).cpu().numpy()  # one sync

    # 4. several columns per step
    def _update(self, plan: list[Chunk], draws: np.ndarray) -> list[StepEvent]:
        k, events, row = self.cfg.num_codebooks, [], 0
        for c in plan:
            s = self._streams[c.sid]
            if not self._wants_audio(c):
                continue
            try:
                d, row = draws[row], row + 1
                if not d[2 * k]:
                    events.append(self._finish(s, "error", "non-finite audio logits"))
                    continue
                cols = s.segment.start() if c.prefill else []
                cols += s.segment.advance(d[:k], d[k:2 * k])
                events += self._column_events(s, cols)
            except Exception as exc:  # one stream's failure must not stop the others
                log.exception("stream %d failed in its state update", s.sid)
                events.append(self._finish(s, "error", f"state update failed: {exc!r}"))
        return events

    def _column_events(self, s: Stream, cols: list[tuple[int, ...]]) -> list[StepEvent]:
        events = [StepEvent(s.sid, np.array(col, np.int64), finished=False) for col in cols[:-1]]
        return events + [self._column_event(s, cols[-1])]
