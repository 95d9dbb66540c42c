"""The batched step engine: one AR step for every active stream per `step()`, any model family.

    schedule -> runner: stage + forward (graph replay) + rules -> writers: rows -> codec frames -> events

The engine owns what every family and device share: admission (`add`, `cancel`, `pause`,
`resume`), the scheduler (admission and prefill under a token budget, scheduler.py), one
`Sequence` per stream (sequence.py), and the step's postprocessing: each stream's rows go through
its family's `FrameWriter` (Higgs: the delay-pattern revert) into codec frames, one `StepEvent`
per frame, the stream's end `finished` on its last frame or an event of its own. What differs
between families is the `policy` (family.GenerationPolicy: prompt with the text track its decode
steps feed, host rule machine, writer, logits processors, how many codebooks the head samples before
the talker completes the row); what differs between devices is the `runner`
(model_runner.py): `ModelRunner` (the fast path: device-resident rules, CUDA graphs) when a
`ModelRunnerConfig` is given, else `RefRunner` (ref_runner.py: the plain-torch reference).

Threads: `add()` and `cancel()` only append to queues, so a server may call them from its event
loop while `step()` runs in a worker thread; `step()` itself must not run twice at once.
Failure isolation: a stream whose logits are not finite, or whose state update raises, finishes
alone with reason "error". A failing forward fails the streams in that batch (their error
events come with the next step) and re-raises.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from higgs_stream.engine.batch import DEFAULT_MAX_POSITIONS
from higgs_stream.engine.errors import CancelledStream, CapacityError, ConfigError, HiggsStreamError, InvalidInputError
from higgs_stream.engine.family import GenerationPolicy, ModelFamily, TokenizerLike
from higgs_stream.engine.fast_talker import FastTalker
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import ModelRunner, ModelRunnerConfig, runner_config
from higgs_stream.engine.runner import RowOut, Runner
from higgs_stream.engine.quantize import check_fp8_device, check_mode, check_supported, quantize_talker
from higgs_stream.kernels.attention import FP8_KV
from higgs_stream.engine.ref_runner import RefRunner
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.sampling import make_generator, resolve_seed
from higgs_stream.engine.scheduler import Chunk, SchedulerConfig
from higgs_stream.engine.sequence import Sequence
from higgs_stream.engine.talker_config import BackboneConfig

log = logging.getLogger(__name__)


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The K/V pool dtype of `EngineConfig.kv_cache_dtype`: the model's, or fp8 e4m3."""
    return FP8_KV if name == "fp8" else model_dtype


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 64  # streams admitted at once
    token_budget: int = 2048  # tokens per forward (decode tokens + prefill chunks)
    max_waiting: int = 256  # queued streams beyond which add() raises CapacityError
    # Context cap: positions per stream (prompt + fed-back rows). REF's serve engine caps at 8192.
    # Not derived from config.json's max_position_embeddings (2048 in the transformers-native file).
    max_seq_len: int = DEFAULT_MAX_POSITIONS
    kv_pages: int = 4096  # pages of the cache `from_pretrained` creates
    page_size: int = 16
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "fp8": e4m3 pages (half of bf16's bytes, unscaled)
    # A prompt arriving while a step runs is launched right behind it, not in the next step (families that
    # sample at the prompt end, on the ModelRunner; others ignore it): engine/model_runner.py, "Late prompts".
    # H100, Qwen3-TTS 1.7B at 20 req/s through the server: TTFA p95 73 vs 97 ms off, same call (docs/PERF.md)
    late_prompts: bool = True
    # ... also while the newest regular step carries prompt chunks (arrivals faster than one a step)? Off: those
    # prompts ride the next regular step, packed. H100, Higgs v3, 256 streams arriving over 2 s, same call: 0 of
    # 418 served streams underran off vs 3 of 331 on (105 vs 190 refused `busy`, 251 vs 220 audio-s/s); on, each
    # late launch of the burst carried one prompt and read the weights for it (docs/PERF.md, session 17)
    late_prompts_in_bursts: bool = False

    def __post_init__(self) -> None:
        for name in ("max_batch", "token_budget", "max_waiting", "max_seq_len", "kv_pages", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"engine {name} must be a positive int, got {value!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
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
    def __init__(
        self,
        talker: torch.nn.Module,
        cfg: BackboneConfig,
        tokenizer: TokenizerLike,
        cache: KVCache,
        config: EngineConfig | None = None,
        runner: ModelRunnerConfig | None = None,
        *,
        family: ModelFamily | None = None,
        fast: FastTalker | None = None,
    ) -> None:
        """`runner`: the fast path's config (`ModelRunner`), None for the plain-torch `RefRunner`.
        `family`: the model family of `cfg` (models/registry.py finds it when None). `fast`: an
        existing FastTalker over the same talker for the ModelRunner to share (no second copy)."""
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
        self.max_seq_len = self.config.max_seq_len
        if runner is None:
            if fast is not None:
                raise ConfigError("a shared FastTalker is for the ModelRunner (pass a ModelRunnerConfig)")
            self.runner: Runner = RefRunner(talker, cfg, cache, self.policy)
        else:
            self.runner = ModelRunner(talker, cfg, cache, self.policy, family, self.config.max_batch,
                                      self.max_seq_len, runner, fast)
        alloc = cache.allocator
        self.scheduler = self.runner.make_scheduler(SchedulerConfig(
            max_batch=self.config.max_batch, token_budget=self.config.token_budget,
            max_waiting=self.config.max_waiting, num_pages=alloc.num_pages, page_size=alloc.page_size,
        ))
        self._ids = itertools.count()
        self._pending: deque[Sequence] = deque()  # added, not yet seen by step()
        self._prompted = False  # the newest regular launch carried prompt chunks (step; late_prompts_in_bursts)
        self._arrived = threading.Event()  # set by add(): a late-prompt wait ends (ModelRunner late_prompts)
        self._cancels: deque[int] = deque()  # stream ids (cancel() may run on another thread)
        self._seqs: dict[int, Sequence] = {}  # id -> live sequence (known to the scheduler, not finished)
        self._carry: list[tuple[Sequence, StepEvent]] = []  # events of a failed step, delivered next step

    @classmethod
    def from_pretrained(
        cls, model: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = torch.float32,
        config: EngineConfig | None = None, runner: ModelRunnerConfig | None = None, quantize: str = "none",
    ) -> Engine:
        """An engine for a checkpoint of any family (by config.json model_type); dtype None: as stored.
        `quantize`: none | int8 | fp8, applied to the loaded talker's backbone linears (engine/quantize.py)."""
        from higgs_stream.engine.models.registry import load_model

        config = config or EngineConfig()
        check_mode(quantize)
        talker, cfg, tokenizer = load_model(model, device=device, dtype=dtype, max_positions=config.max_seq_len)
        quantize_talker(talker, quantize, kernels=runner.kernels if runner is not None else "fast")
        cache = KVCache.create(cfg, num_pages=config.kv_pages, page_size=config.page_size,
                               dtype=kv_cache_dtype(config.kv_cache_dtype, talker.dtype),
                               device=device)
        return cls(talker, cfg, tokenizer, cache, config, runner)

    # ------------------------------------------------------------------ public API
    def check(self, request: GenerationRequest) -> None:
        """InvalidInputError for a request `add` would refuse for what it says (the runner's limits, control tokens in
        its text, scene or instructions), without queueing it: a server checks a whole input before it answers, and
        adds its segments one by one later."""
        if not isinstance(request, GenerationRequest):
            raise InvalidInputError(f"expected a GenerationRequest, got {type(request).__name__}")
        self.runner.check(request)
        self.policy.build_prompt(request)

    def check_transcript(self, transcript: str) -> None:
        """InvalidInputError when `transcript`, as a reference's transcript, holds a control token: the family's
        check that `check` and `add` run on a request's reference (a server runs it on its voice presets at
        start-up, before any request carries one)."""
        if not isinstance(transcript, str):
            raise InvalidInputError(f"a transcript must be a string, got {type(transcript).__name__}")
        self.policy.check_transcript(transcript)

    def add(self, request: GenerationRequest) -> int:
        """Queue a request; returns its stream id. InvalidInputError / CapacityError when refused."""
        if not isinstance(request, GenerationRequest):
            raise InvalidInputError(f"expected a GenerationRequest, got {type(request).__name__}")
        self.runner.check(request)
        prompt = self.policy.build_prompt(request)
        room = self.max_seq_len - len(prompt) - self.cfg.num_codebooks  # frames that fit the context length
        if room < 1:
            raise InvalidInputError(f"prompt takes {len(prompt)} positions; the context length is {self.max_seq_len}")
        if len(self._pending) + self.scheduler.num_waiting >= self.config.max_waiting:
            raise CapacityError(f"too many streams waiting (max_waiting={self.config.max_waiting})")
        params = resolve_seed(request.sampling)
        max_frames = min(request.max_frames, room)
        seq = Sequence(
            sid=next(self._ids), request=request, prompt=prompt, params=params, max_frames=max_frames,
            segment=self.policy.new_segment(prompt, params, max_frames), writer=self.policy.new_writer(),
            generator=make_generator(params.seed, self.device),
        )
        seq.max_tokens = seq.max_kv_tokens + self.runner.kv_slack  # what admission commits
        pages = self.scheduler.config.pages_for(seq.max_tokens)
        if pages > self.scheduler.config.num_pages:
            raise CapacityError(f"stream may need {pages} KV pages, the cache has {self.scheduler.config.num_pages}")
        self._pending.append(seq)
        self._arrived.set()
        return seq.sid

    def cancel(self, stream_id: int) -> None:
        """Stop a stream; its pages are freed and its "cancelled" event emitted at the next step.

        Cancelling a stream that already finished (or never existed) does nothing.
        """
        self._cancels.append(stream_id)

    def pause(self, stream_id: int) -> None:
        """Skip a decoding stream in the next steps (it keeps its KV pages and state); `resume` it later."""
        seq = self._seqs.get(stream_id)
        if seq is not None:
            self.scheduler.pause(seq)

    def resume(self, stream_id: int) -> None:
        seq = self._seqs.get(stream_id)
        if seq is not None:
            self.scheduler.resume(seq)

    def has_work(self) -> bool:
        """Something for `step()` to do (paused streams alone are not)."""
        return bool(self._pending or self._cancels or self._carry or self.runner.busy or self.scheduler.has_work())

    @property
    def wait_s(self) -> float:
        """Host seconds spent waiting for the device so far (benchmarks: host-bound or device-bound)."""
        return self.runner.wait_s

    @property
    def last_prefill(self) -> int:
        """Prompt chunks in the last launched step (benchmarks' traces)."""
        return self.runner.last_prefill

    @property
    def num_active(self) -> int:
        """Streams added and not finished (waiting, prefilling or decoding)."""
        return len(self._pending) + len(self._seqs)

    @torch.inference_mode()
    def step(self, sync: bool = False) -> list[StepEvent]:
        """One AR step for every scheduled stream; returns what happened to each.

        On CUDA a step's rows normally come back with the next step (the host stages step n + 1 while
        the device runs step n). `sync=True` gives up that overlap for latency: with a step in flight
        this call only collects it (nothing new is launched), else it runs one step and returns its own
        rows; nothing is left queued on the device, so a prompt that arrives next waits for at most the
        step then running, not a second one queued behind it."""
        out = self._carry + self._admit_and_cancel()
        self._carry = []
        runner = self.runner
        hold = runner.busy and (sync or runner.in_flight >= 2)  # collect first: at most 2 launches in flight
        plan = [] if hold else self.scheduler.schedule()
        self._reserve(plan)
        if plan:
            self._prompted = any(c.prefill for c in plan)  # the newest regular launch carries prompt chunks
        late = self._late_prompts if self.config.late_prompts and runner.late_prompts else None
        if self._prompted and not self.config.late_prompts_in_bursts:
            late = None  # prompts come faster than one a step: the next regular step packs them
        try:
            rows = runner.run(plan, sync=sync, late=late)
        except Exception as exc:
            self._carry += [self._finish(s, "error", f"forward failed: {exc!r}") for s in _distinct(c.seq for c in plan)]
            raise
        out += self._postprocess(rows)
        return self._deliver(out)

    def stream(self, request: GenerationRequest) -> Iterator[np.ndarray]:
        """Add `request` now and yield its codec frames ([K] int64) as they come, driving step() itself.

        Events of other streams driven the same way are buffered for them. Closing the generator
        early cancels the stream. Raises CancelledStream / HiggsStreamError if it ends that way.
        """
        sid = self.add(request)  # through `add`: a wrapper around it (e.g. random_weights.suppress_eos) applies
        seq = next(s for s in reversed(self._pending) if s.sid == sid)
        seq.outbox = deque()
        gen = self._drive(seq)
        weakref.finalize(gen, self._abandon, seq)  # dropped without ever being iterated
        return gen

    def generate(self, request: GenerationRequest) -> np.ndarray:
        """All codec frames of one request, [K, F] int64 (offline)."""
        frames = list(self.stream(request))
        return np.stack(frames, axis=1) if frames else np.zeros((self.cfg.num_codebooks, 0), np.int64)

    # ------------------------------------------------------------------ step stages
    def _late_prompts(self, timeout_s: float) -> list[Chunk]:
        """The runner waits for a step: the prompts added meanwhile (waiting up to `timeout_s` for one),
        admitted and planned for a launch of their own; [] when none came (or none fits now)."""
        self._arrived.clear()
        chunks = self._admit_late()
        if not chunks and timeout_s > 0:
            self._arrived.wait(timeout_s)
            chunks = self._admit_late()
        return chunks

    def _admit_late(self) -> list[Chunk]:
        """Added and waiting prompts admitted for a late launch, as many as fit now."""
        if not self._pending and not self.scheduler.waiting:
            return []
        self._carry += self._admit()
        chunks = self.scheduler.admit_late(self.runner.config.prefill_pack)
        self._reserve(chunks)
        return chunks

    def _admit_and_cancel(self) -> list[tuple[Sequence, StepEvent]]:
        out = self._admit()
        while self._cancels:
            seq = self._seqs.get(self._cancels.popleft())
            if seq is not None:
                out.append(self._finish(seq, "cancelled"))
        return out

    def _admit(self) -> list[tuple[Sequence, StepEvent]]:
        """Added sequences to the scheduler's queue; a refusal's error event."""
        out = []
        while self._pending:
            seq = self._pending.popleft()
            try:  # add() checked the queue bound and the pages already; only a race with it can get here
                self.scheduler.add(seq)
            except CapacityError as exc:
                out.append((seq, StepEvent(seq.sid, None, True, "error", f"busy: {exc}")))
                continue
            self._seqs[seq.sid] = seq
        return out

    def _reserve(self, plan: list[Chunk]) -> None:
        """KV pages for this step's new tokens (within the scheduler's commitment)."""
        alloc = self.cache.allocator
        for c in plan:
            alloc.reserve(c.sid, c.end)
            c.seq.holds_pages = True

    def _postprocess(self, rows: list[RowOut]) -> list[tuple[Sequence, StepEvent]]:
        """Each sequence's rows -> its writer's codec frames -> events; ended sequences are released."""
        k = self.cfg.num_codebooks
        out: list = []  # (seq, StepEvent) or (seq, frame index or -1, finished)
        frames: list[list[int]] = []
        for seq, seq_rows, end, error in rows:
            if end == "error":
                out.append(self._finish(seq, "error", error))
                continue
            try:
                got = [seq.writer.push(r, final=end is not None and i == len(seq_rows) - 1)
                       for i, r in enumerate(seq_rows)]
            except Exception as exc:  # one stream's failure must not stop the others
                log.exception("stream %d failed in its state update", seq.sid)
                out.append(self._finish(seq, "error", f"state update failed: {exc!r}"))
                continue
            got = [f for f in got if f is not None]
            if end is not None:
                self._release(seq, end)
            for i, f in enumerate(got):
                frames.append(f)
                out.append((seq, len(frames) - 1, end is not None and i == len(got) - 1))
            if end is not None and not got:
                out.append((seq, -1, True))
        table = np.array(frames, np.int64).reshape(len(frames), k)  # one array for every frame of the step
        return [e if len(e) == 2 else
                (e[0], StepEvent(e[0].sid, table[e[1]] if e[1] >= 0 else None, e[2], e[0].reason if e[2] else None))
                for e in out]

    # ------------------------------------------------------------------ helpers
    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> tuple[Sequence, StepEvent]:
        self._release(seq, reason, error)
        return seq, StepEvent(seq.sid, None, finished=True, reason=reason, error=error)

    def _release(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.reason, seq.error = reason, error
        self.scheduler.finish(seq)
        self.runner.release(seq)
        if seq.holds_pages:
            self.cache.allocator.free(seq.sid)
            seq.holds_pages = False
        del self._seqs[seq.sid]

    @staticmethod
    def _deliver(out: list[tuple[Sequence, StepEvent]]) -> list[StepEvent]:
        """Queue each event for the generator driving its stream, if one does; the step's events."""
        for seq, ev in out:
            if seq.outbox is not None:
                seq.outbox.append(ev)
        return [ev for _, ev in out]

    def _abandon(self, seq: Sequence) -> None:
        if seq.outbox is not None:
            seq.outbox = None
            self.cancel(seq.sid)

    def _drive(self, seq: Sequence) -> Iterator[np.ndarray]:
        box, done = seq.outbox, False
        try:
            while not done:
                if not box:
                    assert self.has_work(), f"stream {seq.sid} is unfinished but the engine has no work"
                    self.step()
                    continue
                ev = box.popleft()
                done = ev.finished
                if ev.frame is not None:
                    yield ev.frame
                if ev.reason == "cancelled":
                    raise CancelledStream(f"stream {seq.sid} was cancelled")
                if ev.reason == "error":
                    raise HiggsStreamError(f"stream {seq.sid} failed: {ev.error}")
        finally:
            seq.outbox = None
            if not done:
                self.cancel(seq.sid)


def _distinct(seqs: Iterable[Sequence]) -> list[Sequence]:
    """The live sequences among `seqs`, each once (a plan may hold two chunks of one)."""
    out: list[Sequence] = []
    for s in seqs:
        if not s.finished and all(s is not o for o in out):
            out.append(s)
    return out


def load_engine(model: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                config: EngineConfig | None = None, cuda_graphs: bool = True, kernels: str = "fast",
                quantize: str = "none", runner_options: Mapping[str, Any] | None = None) -> Engine:
    """The engine `serve` and `synth` run: on CUDA the fast path (`ModelRunner`: Triton + FlashInfer
    kernels, decode steps replayed from CUDA graphs unless `cuda_graphs=False`; `runner_options`: the other
    fields of its ModelRunnerConfig, e.g. prefill_pack), bf16 unless
    `dtype` says otherwise; elsewhere the plain-torch `RefRunner` in fp32 (or `dtype`). `quantize`
    (none | int8 | fp8, engine/quantize.py) is checked against the device before the checkpoint is read."""
    dev = torch.device(device)
    if dev.type == "cuda":
        dtype = dtype or torch.bfloat16
        check_supported(quantize, dev, dtype, kernels)
        if config is not None and config.kv_cache_dtype == "fp8" and kernels == "fast":
            check_fp8_device(dev, "--kv-cache-dtype fp8")
        return Engine.from_pretrained(model, device=device, dtype=dtype, config=config,
                                      runner=runner_config(quantize, cuda_graphs, kernels, runner_options),
                                      quantize=quantize)
    if not cuda_graphs:
        log.info("--no-cuda-graphs has no effect on %s", device)
    dtype = dtype or torch.float32
    check_supported(quantize, dev, dtype)
    return Engine.from_pretrained(model, device=device, dtype=dtype, config=config, quantize=quantize)
