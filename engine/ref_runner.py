"""The reference runner: one step of every scheduled sequence in plain torch, on any device.

    prepare the ragged host batch -> talker.forward (StepBatch, paged KV) -> sample (sampling.py,
    per-stream generators) -> the family's host rule machine (Segment) -> this step's rows

Prefill chunks and decode tokens of many sequences share one forward under the token budget
(scheduler.Scheduler). It runs each family's plain-torch talker (the one pinned against the
transformers reference) and host rule machines, so it is the oracle the fast path
(model_runner.ModelRunner) is tested against, and the engine's CPU path. Each step makes one
device->host copy (the sampled ids); its rows are returned in the same step (no lag).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from higgs_stream.engine.batch import StepBatch, StepOutput
from higgs_stream.engine.family import GenerationPolicy
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import RowOut, samples_at
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.sampling import SamplingTensors, sample_columns
from higgs_stream.engine.scheduler import Chunk, Scheduler, SchedulerConfig
from higgs_stream.engine.sequence import Sequence
from higgs_stream.engine.talker_config import BackboneConfig

log = logging.getLogger(__name__)


class RefRunner:
    kv_slack = 0  # rows come back in their own step: nothing is scheduled after the end
    busy = False
    wait_s = 0.0  # no asynchronous device work to wait for (benchmarks read the ModelRunner's)
    last_prefill = 0

    def __init__(self, talker: torch.nn.Module, cfg: BackboneConfig, cache: KVCache, policy: GenerationPolicy) -> None:
        self.talker, self.cfg, self.cache, self.policy = talker, cfg, cache, policy

    def make_scheduler(self, config: SchedulerConfig) -> Scheduler:
        return Scheduler(config)

    def check(self, request: GenerationRequest) -> None:
        """Every request the engine accepts runs here."""

    def release(self, seq: Sequence) -> None:
        """Nothing is held per sequence beyond what the engine frees."""

    def run(self, plan: list[Chunk]) -> list[RowOut]:
        if not plan:
            return []
        out = self.talker.forward(self._prepare_inputs(plan), self.cache)
        return self._update(plan, self._sample(plan, out))

    # ------------------------------------------------------------------ stages
    def _prepare_inputs(self, plan: list[Chunk]) -> StepBatch:
        """The ragged host batch of this step (its KV pages are reserved)."""
        k = self.cfg.num_codebooks
        ids, codes, is_audio, positions = [], [], [], []
        for c in plan:
            s = c.seq
            if c.prefill:
                p = s.prompt
                ids.append(p.input_ids[c.start:c.end])
                codes.append(p.audio_codes[c.start:c.end])
                is_audio.append(p.is_audio[c.start:c.end])
            else:  # feed back the last row as one audio position
                ids.append(np.array([self.policy.continuation_id], np.int64))
                codes.append(np.array(s.segment.last_column, np.int64).reshape(1, k))
                is_audio.append(np.ones(1, bool))
            positions.append(np.arange(c.start, c.end, dtype=np.int64))
        return StepBatch(
            seq_ids=[c.sid for c in plan], qo_lens=[c.num_tokens for c in plan],
            input_ids=torch.from_numpy(np.concatenate(ids)),  # [N]
            audio_codes=torch.from_numpy(np.concatenate(codes)),  # [N, K]
            is_audio=torch.from_numpy(np.concatenate(is_audio)),  # [N]
            positions=torch.from_numpy(np.concatenate(positions)),  # [N]
            want_text=torch.zeros(len(plan), dtype=torch.bool),  # audio is forced: no text head
            want_audio=torch.tensor([samples_at(c, self.policy) for c in plan], dtype=torch.bool),  # [B]
        )

    def _sample(self, plan: list[Chunk], out: StepOutput) -> np.ndarray:
        """[S, 2*K + 1] host ids: sampled ids, RAS candidates and a finite-logits flag per sampled row."""
        rows = [i for i, c in enumerate(plan) if samples_at(c, self.policy)]
        if not rows:
            return np.zeros((0, 2 * self.cfg.num_codebooks + 1), np.int64)
        seqs = [plan[i].seq for i in rows]
        logits = out.audio_logits[torch.tensor(rows, device=out.audio_logits.device)]  # [S, K, V]
        st = SamplingTensors.build([s.params for s in seqs], self.cfg.audio_vocab, logits.device)
        draws = sample_columns(logits, st, [s.generator for s in seqs])  # [S, 2, K]
        finite = torch.isfinite(logits).all(dim=2).all(dim=1)  # [S]
        return torch.cat([draws.flatten(1), finite[:, None].long()], dim=1).cpu().numpy()  # one sync

    def _update(self, plan: list[Chunk], draws: np.ndarray) -> list[RowOut]:
        """Advance each sequence's segment: `start()` at its prompt's end, `advance()` per sampled row."""
        k, out, row = self.cfg.num_codebooks, [], 0
        for c in plan:
            if c.prefill and not c.last_of_prompt:
                continue
            s = c.seq
            d = None
            if samples_at(c, self.policy):
                d, row = draws[row], row + 1
                if not d[2 * k]:
                    out.append(RowOut(s, [], "error", "non-finite audio logits"))
                    continue
            try:
                rows = s.segment.start() if c.prefill else []  # a forced start row is the writer's
                if d is not None:
                    rows += s.segment.advance(d[:k], d[k : 2 * k])
            except Exception as exc:  # one stream's failure must not stop the others
                log.exception("stream %d failed in its state update", s.sid)
                out.append(RowOut(s, [], "error", f"state update failed: {exc!r}"))
                continue
            out.append(RowOut(s, rows, s.segment.reason if s.segment.finished else None))
        return out
