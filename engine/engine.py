"""The batched step engine: one AR step for every active stream per `step()`.

    schedule -> prepare inputs -> forward -> sample -> update per-stream state

Prefill chunks and decode tokens of many streams share one ragged forward under a token budget
(scheduler.py). What differs between model families is the engine's `policy`
(family.GenerationPolicy, from the family of the talker config, models/registry.py): the prompt,
the per-stream `Segment` state machine (models/<family>/policy.py), the text id of a decode
step's input (the fed-back row is its audio codes) and whether the prompt's last position is
sampled or yields a forced start row only. The engine emits codec frames: each stream's rows go
through its family's `FrameWriter` (Higgs: the delay-pattern revert), each frame becomes one
StepEvent, and the stream's end is `finished` on its last frame or an event of its own. Sampling
with per-stream generators is sampling.py. Each step makes one device->host copy (the sampled ids); nothing in a step waits on
anything but compute.

Threads: `add()` and `cancel()` only append to queues, so a server may call them from its event
loop while `step()` runs in a worker thread; `step()` itself must not run twice at once.
Failure isolation: a stream whose logits are not finite, or whose state update raises, finishes
alone with reason "error". A failing forward fails the streams in that batch (their error
events come with the next step) and re-raises.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from higgs_stream.engine.batch import DEFAULT_MAX_POSITIONS, StepBatch, StepOutput
from higgs_stream.engine.errors import CancelledStream, CapacityError, ConfigError, HiggsStreamError, InvalidInputError
from higgs_stream.engine.family import GenerationPolicy, ModelFamily, Row, TokenizerLike
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.sampling import SamplingTensors, make_generator, resolve_seed, sample_columns
from higgs_stream.engine.scheduler import Chunk, Scheduler, SchedulerConfig
from higgs_stream.engine.sequence import Stream
from higgs_stream.engine.talker_config import BackboneConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 64  # streams admitted at once
    token_budget: int = 2048  # tokens per forward (decode tokens + prefill chunks)
    max_waiting: int = 256  # queued streams beyond which add() raises CapacityError
    # Context cap: positions per stream (prompt + fed-back columns). REF's serve engine caps at 8192.
    # Not derived from config.json's max_position_embeddings (2048 in the transformers-native file).
    max_seq_len: int = DEFAULT_MAX_POSITIONS
    kv_pages: int = 4096  # pages of the cache `from_pretrained` creates
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_batch", "token_budget", "max_waiting", "max_seq_len", "kv_pages", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"engine {name} must be a positive int, got {value!r}")
        if self.token_budget < self.max_batch:
            raise ConfigError(f"token_budget ({self.token_budget}) must be >= max_batch ({self.max_batch})")


@dataclass(frozen=True)
class StepEvent:
    """What one step did for one stream: a new codec frame and/or the end of the stream."""

    stream_id: int
    frame: np.ndarray | None  # [K] int64 codec codes, 0..codebook_size-1
    finished: bool
    reason: str | None = None  # when finished: "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # message when reason == "error"


class Engine:
    # KV positions a stream may use beyond `max_kv_tokens` (GpuEngine: one step of lag). add() and
    # admission both commit `max_kv_tokens + kv_slack`, so a request add() accepts always fits.
    kv_slack = 0

    def __init__(
        self,
        talker: torch.nn.Module,
        cfg: BackboneConfig,
        tokenizer: TokenizerLike,
        cache: KVCache,
        config: EngineConfig | None = None,
        family: ModelFamily | None = None,
    ) -> None:
        """`family`: the model family of `cfg` (models/registry.py finds it when None)."""
        if family is None:
            from higgs_stream.engine.models.registry import family_of_config

            family = family_of_config(cfg)
        self.config = config or EngineConfig()
        if cfg.special is not None and cfg.special != tokenizer.special:
            raise ConfigError(f"tokenizer and talker config disagree on special token ids: "
                              f"{tokenizer.special} vs {cfg.special}")
        self.talker, self.cfg, self.tokenizer, self.cache = talker, cfg, tokenizer, cache
        self.family = family
        self.policy: GenerationPolicy = family.policy(cfg, tokenizer)
        self.device = next(talker.parameters()).device
        alloc = cache.allocator
        self.scheduler = Scheduler(SchedulerConfig(
            max_batch=self.config.max_batch, token_budget=self.config.token_budget,
            max_waiting=self.config.max_waiting, num_pages=alloc.num_pages, page_size=alloc.page_size,
        ))
        self.max_seq_len = self.config.max_seq_len
        self._ids = itertools.count()
        self._pending: deque[Stream] = deque()  # added, not yet seen by step()
        self._cancels: deque[int] = deque()
        self._streams: dict[int, Stream] = {}  # known to the scheduler, not finished
        self._holds_pages: set[int] = set()
        self._carry: list[StepEvent] = []  # events produced by a failed step, delivered next step
        self._outboxes: dict[int, deque[StepEvent]] = {}  # streams driven by stream()/generate()

    @classmethod
    def from_pretrained(
        cls, model: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32,
        config: EngineConfig | None = None,
    ) -> Engine:
        """An engine for a checkpoint of any family (by config.json model_type); dtype None: as stored."""
        from higgs_stream.engine.models.registry import load_model

        config = config or EngineConfig()
        talker, cfg, tokenizer = load_model(model, device=device, dtype=dtype, max_positions=config.max_seq_len)
        cache = KVCache.create(cfg, num_pages=config.kv_pages, page_size=config.page_size, dtype=talker.dtype,
                               device=device)
        return cls(talker, cfg, tokenizer, cache, config)

    # ------------------------------------------------------------------ public API
    def add(self, request: GenerationRequest) -> int:
        """Queue a request; returns its stream id. InvalidInputError / CapacityError when refused."""
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
        stream = Stream(
            sid=next(self._ids), request=request, prompt=prompt, params=params, max_frames=max_frames,
            generator=make_generator(params.seed, self.device),
            segment=self.policy.new_segment(prompt, params, max_frames), writer=self.policy.new_writer(),
        )
        pages = self.scheduler.config.pages_for(self._kv_commitment(stream))
        if pages > self.scheduler.config.num_pages:
            raise CapacityError(f"stream may need {pages} KV pages, the cache has {self.scheduler.config.num_pages}")
        self._pending.append(stream)
        return stream.sid

    def cancel(self, stream_id: int) -> None:
        """Stop a stream; its pages are freed and its "cancelled" event emitted at the next step.

        Cancelling a stream that already finished (or never existed) does nothing.
        """
        self._cancels.append(stream_id)

    def pause(self, stream_id: int) -> None:
        """Skip a decoding stream in the next steps (it keeps its KV pages and state); `resume` it later."""
        self.scheduler.pause(stream_id)

    def resume(self, stream_id: int) -> None:
        self.scheduler.resume(stream_id)

    def has_work(self) -> bool:
        """Something for `step()` to do (paused streams alone are not)."""
        return bool(self._pending or self._cancels or self._carry or self.scheduler.has_work())

    @property
    def num_active(self) -> int:
        """Streams added and not finished (waiting, prefilling or decoding)."""
        return len(self._pending) + len(self._streams)

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        """One AR step for every scheduled stream; returns what happened to each."""
        events = self._carry + self._admit_and_cancel()
        self._carry = []
        plan = self.scheduler.schedule()
        if plan:
            batch = self._prepare_inputs(plan)
            out = self._forward(plan, batch)
            draws = self._sample(plan, out)
            events += self._update(plan, draws)
        self._deliver(events)
        return events

    def stream(self, request: GenerationRequest) -> Iterator[np.ndarray]:
        """Add `request` now and yield its codec frames ([K] int64) as they come, driving step() itself.

        Events of other streams driven the same way are buffered for them. Closing the generator
        early cancels the stream. Raises CancelledStream / HiggsStreamError if it ends that way.
        """
        sid = self.add(request)
        self._outboxes[sid] = deque()
        gen = self._drive(sid)
        weakref.finalize(gen, self._abandon, sid)  # dropped without ever being iterated
        return gen

    def generate(self, request: GenerationRequest) -> np.ndarray:
        """All codec frames of one request, [K, F] int64 (offline)."""
        frames = list(self.stream(request))
        return np.stack(frames, axis=1) if frames else np.zeros((self.cfg.num_codebooks, 0), np.int64)

    # ------------------------------------------------------------------ step stages
    def _admit_and_cancel(self) -> list[StepEvent]:
        events = []
        while self._pending:
            stream = self._pending.popleft()
            try:  # add() checked the queue bound and the pages already; only a race with it can get here
                self.scheduler.add(stream.sid, stream.prompt_len, self._kv_commitment(stream))
            except CapacityError as exc:
                events.append(StepEvent(stream.sid, None, True, "error", f"busy: {exc}"))
                continue
            self._streams[stream.sid] = stream
        while self._cancels:
            sid = self._cancels.popleft()
            if sid in self._streams:
                events.append(self._finish(self._streams[sid], "cancelled"))
        return events

    def _prepare_inputs(self, plan: list[Chunk]) -> StepBatch:
        """The ragged host batch of this step; reserves KV pages for its new tokens."""
        k = self.cfg.num_codebooks
        ids, codes, is_audio, positions = [], [], [], []
        for c in plan:
            s = self._streams[c.sid]
            self.cache.allocator.reserve(c.sid, c.end)  # within the scheduler's commitment
            self._holds_pages.add(c.sid)
            if c.prefill:
                p = s.prompt
                ids.append(p.input_ids[c.start:c.end])
                codes.append(p.audio_codes[c.start:c.end])
                is_audio.append(p.is_audio[c.start:c.end])
            else:  # feed back the last column as one audio position
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
            want_audio=torch.tensor([self._wants_audio(c) for c in plan], dtype=torch.bool),  # [B]
        )

    def _forward(self, plan: list[Chunk], batch: StepBatch) -> StepOutput:
        try:
            return self.talker.forward(batch, self.cache)
        except Exception as exc:
            self._carry = [self._finish(self._streams[c.sid], "error", f"forward failed: {exc!r}") for c in plan]
            raise

    def _sample(self, plan: list[Chunk], out: StepOutput) -> np.ndarray:
        """[S, 2*K + 1] host ids: sampled ids, RAS candidates and a finite-logits flag per sampled row."""
        rows = [i for i, c in enumerate(plan) if self._wants_audio(c)]
        if not rows:
            return np.zeros((0, 2 * self.cfg.num_codebooks + 1), np.int64)
        streams = [self._streams[plan[i].sid] for i in rows]
        logits = out.audio_logits[torch.tensor(rows, device=out.audio_logits.device)]  # [S, K, V]
        st = SamplingTensors.build([s.params for s in streams], self.cfg.audio_vocab, logits.device)
        draws = sample_columns(logits, st, [s.generator for s in streams])  # [S, 2, K]
        finite = torch.isfinite(logits).all(dim=2).all(dim=1)  # [S]
        return torch.cat([draws.flatten(1), finite[:, None].long()], dim=1).cpu().numpy()  # one sync

    def _update(self, plan: list[Chunk], draws: np.ndarray) -> list[StepEvent]:
        """Advance each stream's segment: `start()` at its prompt's end, `advance()` per sampled row."""
        k, events, row = self.cfg.num_codebooks, [], 0
        for c in plan:
            if c.prefill and not c.last_of_prompt:
                continue
            s = self._streams[c.sid]
            d = None
            if self._wants_audio(c):
                d, row = draws[row], row + 1
                if not d[2 * k]:
                    events.append(self._finish(s, "error", "non-finite audio logits"))
                    continue
            try:
                rows = s.segment.start() if c.prefill else []  # a forced start row is the writer's
                if d is not None:
                    rows += s.segment.advance(d[:k], d[k : 2 * k])
                events += self._frame_events(s, rows)
            except Exception as exc:  # one stream's failure must not stop the others
                log.exception("stream %d failed in its state update", s.sid)
                events.append(self._finish(s, "error", f"state update failed: {exc!r}"))
        return events

    # ------------------------------------------------------------------ helpers
    def _kv_commitment(self, s: Stream) -> int:
        """KV positions committed for `s` at admission (what add() checks against the cache)."""
        return s.max_kv_tokens + self.kv_slack

    def _wants_audio(self, c: Chunk) -> bool:
        """Whether this chunk's last position is sampled: every decode step, and the prompt end if the family samples there."""
        return not c.prefill or (c.last_of_prompt and self.policy.sample_at_prompt_end)

    def _frame_events(self, s: Stream, rows: list[Row]) -> list[StepEvent]:
        """One event per codec frame the stream's writer makes of its emitted rows; the segment's
        end finishes the stream, on its last frame or with an event of its own."""
        finished = s.segment.finished
        frames = [s.writer.push(row, final=finished and i == len(rows) - 1) for i, row in enumerate(rows)]
        events = [StepEvent(s.sid, np.array(f, np.int64), finished=False) for f in frames if f is not None]
        if finished:
            self._release(s, s.segment.reason)
            if events:
                events[-1] = replace(events[-1], finished=True, reason=s.reason)
            else:
                events.append(StepEvent(s.sid, None, finished=True, reason=s.reason))
        return events

    def _finish(self, s: Stream, reason: str, error: str | None = None) -> StepEvent:
        self._release(s, reason, error)
        return StepEvent(s.sid, None, finished=True, reason=reason, error=error)

    def _release(self, s: Stream, reason: str, error: str | None = None) -> None:
        s.reason, s.error = reason, error
        self.scheduler.finish(s.sid)
        if s.sid in self._holds_pages:
            self.cache.allocator.free(s.sid)
            self._holds_pages.discard(s.sid)
        del self._streams[s.sid]

    def _deliver(self, events: list[StepEvent]) -> None:
        for ev in events:
            box = self._outboxes.get(ev.stream_id)
            if box is not None:
                box.append(ev)

    def _abandon(self, sid: int) -> None:
        if self._outboxes.pop(sid, None) is not None:
            self.cancel(sid)

    def _drive(self, sid: int) -> Iterator[np.ndarray]:
        box, done = self._outboxes[sid], False
        try:
            while not done:
                if not box:
                    assert self.has_work(), f"stream {sid} is unfinished but the engine has no work"
                    self.step()
                    continue
                ev = box.popleft()
                done = ev.finished
                if ev.frame is not None:
                    yield ev.frame
                if ev.reason == "cancelled":
                    raise CancelledStream(f"stream {sid} was cancelled")
                if ev.reason == "error":
                    raise HiggsStreamError(f"stream {sid} failed: {ev.error}")
        finally:
            self._outboxes.pop(sid, None)
            if not done:
                self.cancel(sid)
