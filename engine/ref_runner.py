"""The reference runner: one step of every scheduled sequence in plain torch, on any device.

    prepare the ragged host batch -> talker.forward (StepBatch, paged KV) -> the family's logits
    processors -> sample (sampling.py, per-stream generators) [-> the family completes the rows:
    talker.complete_rows] -> the family's host rule machine (Segment) -> this step's rows

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
from higgs_stream.engine.family import NO_ID, GenerationPolicy
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.runner import RowOut, samples_at
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.sampling import SamplingTensors, sample_columns
from higgs_stream.engine.scheduler import Chunk, Scheduler, SchedulerConfig
from higgs_stream.engine.sequence import Sequence
from higgs_stream.engine.talker_config import BackboneConfig

log = logging.getLogger(__name__)


class RefRunner:
    kv_slack = 0  # rows come back in their own step: nothing is scheduled after the end
    busy = False
    in_flight = 0
    late_prompts = False  # nothing runs while the host waits: no prompt can come late
    wait_s = 0.0  # no asynchronous device work to wait for (benchmarks read the ModelRunner's)
    last_prefill = 0  # prompt chunks in the last step (benchmarks' and serve --trace-out's traces)

    def __init__(self, talker: torch.nn.Module, cfg: BackboneConfig, cache: KVCache, policy: GenerationPolicy) -> None:
        self.talker, self.cfg, self.cache, self.policy = talker, cfg, cache, policy

    def make_scheduler(self, config: SchedulerConfig) -> Scheduler:
        return Scheduler(config)

    def check(self, request: GenerationRequest) -> None:
        """Every request the engine accepts runs here."""

    def gemv_choices(self) -> dict:
        """None: the plain-torch path runs every linear through torch (engine/gemv_choice.py is the fast path's)."""
        return {}

    def release(self, seq: Sequence) -> None:
        """Nothing is held per sequence beyond what the engine frees."""

    def run(self, plan: list[Chunk], sync: bool = False, late=None) -> list[RowOut]:
        """This step's rows (always synchronous: `sync` and `late` change nothing)."""
        self.last_prefill = sum(1 for c in plan if c.prefill)  # prompt chunks in this step (traces)
        if not plan:
            return []
        out = self.talker.forward(self._prepare_inputs(plan), self.cache)
        return self._update(plan, self._sample(plan, out))

    # ------------------------------------------------------------------ stages
    def _prepare_inputs(self, plan: list[Chunk]) -> StepBatch:
        """The ragged host batch of this step (its KV pages are reserved): prompt rows as the prompt
        holds them; a decode row feeds the sequence's last row on the codec track and the next id of
        its prompt's text track."""
        k = self.cfg.num_codebooks
        ids, codes, is_audio, positions, codec, vec_rows, vecs = [], [], [], [], [], [], []
        with_codec = any(c.prefill and c.seq.prompt.codec_ids is not None for c in plan)
        row = 0  # first row of this chunk in the step's N
        for c in plan:
            s, p = c.seq, c.seq.prompt
            if c.prefill:
                ids.append(p.input_ids[c.start:c.end])
                codes.append(p.audio_codes[c.start:c.end])
                is_audio.append(p.is_audio[c.start:c.end])
                if with_codec:
                    codec.append(p.codec_ids[c.start:c.end] if p.codec_ids is not None else
                                 np.full(c.num_tokens, NO_ID, np.int64))
                inside = (p.vector_rows >= c.start) & (p.vector_rows < c.end)
                if inside.any():
                    vec_rows.append(p.vector_rows[inside] - c.start + row)
                    vecs.append(p.vectors[inside])
            else:  # feed back the last row as one audio position
                ids.append(np.array([p.step_text_id(c.start - s.prompt_len)], np.int64))
                codes.append(np.array(s.segment.last_column, np.int64).reshape(1, k))
                is_audio.append(np.ones(1, bool))
                if with_codec:
                    codec.append(np.full(1, NO_ID, np.int64))
            positions.append(np.arange(c.start, c.end, dtype=np.int64))
            row += c.num_tokens
        return StepBatch(
            seq_ids=[c.sid for c in plan], qo_lens=[c.num_tokens for c in plan],
            input_ids=torch.from_numpy(np.concatenate(ids)),  # [N]
            audio_codes=torch.from_numpy(np.concatenate(codes)),  # [N, K]
            is_audio=torch.from_numpy(np.concatenate(is_audio)),  # [N]
            positions=torch.from_numpy(np.concatenate(positions)),  # [N]
            want_text=torch.zeros(len(plan), dtype=torch.bool),  # audio is forced: no text head
            want_audio=torch.tensor([samples_at(c, self.policy) for c in plan], dtype=torch.bool),  # [B]
            codec_ids=torch.from_numpy(np.concatenate(codec)) if with_codec else None,  # [N]
            vector_rows=torch.from_numpy(np.concatenate(vec_rows)) if vec_rows else None,  # [V]
            vectors=torch.from_numpy(np.concatenate(vecs)) if vecs else None,  # [V, H]
        )

    def _sample(self, plan: list[Chunk], out: StepOutput) -> np.ndarray:
        """[S, 2*K + 1] host ids: sampled rows, RAS candidates and a finite-logits flag per sampled row.

        The talker's head samples the first `head_codebooks` of a row (after the family's logits
        processors); a family that completes rows (family.RowCompleter) writes the rest for every
        sampled row at once, each stream sampling with its own generator."""
        k, h = self.cfg.num_codebooks, self.policy.head_codebooks
        rows = [i for i, c in enumerate(plan) if samples_at(c, self.policy)]
        if not rows:
            return np.zeros((0, 2 * k + 1), np.int64)
        seqs = [plan[i].seq for i in rows]
        at = torch.tensor(rows, device=out.audio_logits.device)
        logits = out.audio_logits[at]  # [S, h, V]
        assert logits.shape[1] == h, f"the talker gave {logits.shape[1]} codebooks of logits, the policy samples {h}"
        finite = torch.isfinite(logits).all(dim=2).all(dim=1)  # [S], on the raw logits
        logits = self.policy.process_logits(logits, [s.segment for s in seqs])
        params, gens = [s.params for s in seqs], [s.generator for s in seqs]
        st = SamplingTensors.build(params, self.cfg.audio_vocab, logits.device)
        draws = sample_columns(logits, st, gens)  # [S, 2, h]
        tokens, ras = draws[:, 0], draws[:, 1]
        if h < k:
            assert out.hidden is not None, "a family that completes rows needs StepOutput.hidden"
            tokens, ok = self._complete(out.hidden[at], tokens, params, gens)  # [S, K]
            ras = torch.cat([ras, tokens[:, h:]], dim=1)  # no RAS candidates for the completed codebooks
            finite &= ok
        return torch.cat([tokens, ras, finite[:, None].long()], dim=1).cpu().numpy()  # one sync

    def _complete(self, hidden: torch.Tensor, head: torch.Tensor, params: list, gens: list
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole rows [S, K] from the talker's `complete_rows`, and whether every logit it sampled from
        was finite [S]."""
        st = SamplingTensors.build(params, self.cfg.codebook_size, hidden.device)
        ok = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)

        def pick(_codebook: int, logits: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S]
            nonlocal ok
            ok = ok & torch.isfinite(logits).all(dim=1)
            return sample_columns(logits[:, None], st, gens)[:, 0, 0]

        full = self.talker.complete_rows(hidden, head, pick)  # [S, K]
        return full, ok

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
