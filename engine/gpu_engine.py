"""The engine's GPU path: the same API and scheduling as `Engine`, with the step on the device.

    schedule -> stage inputs -> forward (graph replay on decode-only steps) -> sample + the family's
             row rules -> one async copy of the new rows -> (next call) each stream's writer turns
             its row into a codec frame

Per-stream generation state (last row, delay/EOS counters, RAS window, seeds, sampling
parameters) lives in `DeviceStreamState`, so a decode step feeds its own output back without the
host. The host runs one step ahead of its results: `step()` launches step t, then waits for step
t-1's rows (already copied to pinned memory while step t ran) and turns them into events. A
stream that finished at t-1 is therefore scheduled once more at t; the device ignores that row
(and the scheduler's KV commitment has one position of slack for it).

Decode rows replay a CUDA graph per batch bucket (engine/cuda_graph.py), also in steps that
prefill other streams. Prompts are prefilled one sequence per forward, cut at multiples of
`GpuEngineConfig.prefill_chunk` tokens whatever else is running (`PrefillScheduler`), so a
stream's K/V and logits do not depend on what shares its steps: with batch-invariant decode
steps, greedy codes of streams served together equal each stream served alone. An all-text first
chunk (e.g. a Higgs v2 prompt without reference or history) replays a prefill graph per length
bucket (`PrefillGraphs`); other chunks run eagerly with FlashInfer's paged prefill.
A family whose prompt end yields a forced start row instead of a sample (`sample_at_prompt_end`
False: Higgs v2's AUDIO_INIT) has that step folded into the prompt's last step: the first decode
token (the start row, at the position after the prompt) joins the same step's decode rows, after
the prefill on the device. The first sampled row so comes one step earlier; the codes are the
same function of the same inputs.
`GpuEngineConfig(kernels="ref", cuda_graphs=False)` runs the identical step logic with the
plain-torch kernels on any device: on the CPU, in fp32, it reproduces the CPU engine's greedy
codes (tests/engine/test_gpu_engine.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from higgs_stream.engine.cuda_graph import DEFAULT_BUCKETS, DecodeGraphs, PrefillGraphs
from higgs_stream.engine.device_copy import upload
from higgs_stream.engine.engine import Engine, EngineConfig, StepEvent
from higgs_stream.engine.errors import ConfigError, InvalidInputError
from higgs_stream.engine.family import ModelFamily, TokenizerLike
from higgs_stream.engine.fast_talker import FastInputs, FastTalker, KernelUnavailable
from higgs_stream.engine.gpu_sampling import ERROR, IGNORED, RUNNING, STATUS_REASON, DeviceStreamState, StreamStart
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.scheduler import Chunk, Scheduler, SchedulerConfig
from higgs_stream.engine.sequence import Stream
from higgs_stream.engine.talker_config import BackboneConfig
from higgs_stream.kernels._triton import KernelUnavailableError
from higgs_stream.kernels.attention import PagedLayout
from higgs_stream.kernels.flashinfer_attention import FlashInferAttention, HostCSR, RefAttention

log = logging.getLogger(__name__)

SCRATCH_SEQ = -1  # allocator id of the page padded graph rows write into
LAG_SLACK = 1  # extra KV positions a stream may be scheduled for after it finished (one step of lag)


@dataclass(frozen=True)
class GpuEngineConfig:
    kernels: str = "fast"  # "fast" (Triton + FlashInfer, CUDA) | "ref" (plain torch, any device)
    cuda_graphs: bool = True  # replay decode-only steps from captured graphs (needs kernels="fast")
    graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    ras_window_max: int = 16  # longest RAS window a request may ask for
    prefill_chunk: int = 512  # prompt tokens per prefill forward (capped by token_budget - max_batch)

    def __post_init__(self) -> None:
        if self.kernels not in ("fast", "ref"):
            raise ConfigError(f"kernels must be 'fast' or 'ref', got {self.kernels!r}")
        if self.cuda_graphs and self.kernels != "fast":
            raise ConfigError("cuda_graphs need kernels='fast'")
        if not self.graph_buckets or min(self.graph_buckets) < 1:
            raise ConfigError(f"graph_buckets must be positive, got {self.graph_buckets}")
        if self.ras_window_max < 1:
            raise ConfigError(f"ras_window_max must be >= 1, got {self.ras_window_max}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


class PrefillScheduler(Scheduler):
    """`Scheduler` whose prompt chunks depend on the prompt alone: a prompt is cut at multiples of
    `chunk` tokens, and a chunk waits for a step whose budget holds it whole (never split by the
    budget other streams left). With chunk < token_budget - max_batch the oldest unfinished
    prompt always fits, so prefill cannot starve. `fold_first_decode`: a prompt's last chunk
    brings the stream's first decode token into the same plan (v2's AUDIO_INIT column)."""

    def __init__(self, config: SchedulerConfig, chunk: int, fold_first_decode: bool = False) -> None:
        super().__init__(config)
        if not 1 <= chunk < config.token_budget - config.max_batch:
            raise ConfigError(f"prefill chunk {chunk} must be in 1..token_budget - max_batch - 1 "
                              f"({config.token_budget} - {config.max_batch} - 1)")
        self.chunk, self.fold = chunk, fold_first_decode

    def schedule(self) -> list[Chunk]:
        budget = self.config.token_budget
        plan: list[Chunk] = []
        budget -= self._plan_decodes(plan)  # 1. decode tokens
        for e in self._running.values():  # 2. unfinished prompts, oldest first
            if not e.decoding:
                if min(e.prompt_len - e.computed, self.chunk) > budget:
                    break
                budget -= self._chunk_of(e, plan)
        while self._waiting and len(self._running) < self.config.max_batch:  # 3. admit, queue head first
            head = self._waiting[0]
            if self.committed_pages + head.pages > self.config.num_pages or min(head.prompt_len, self.chunk) > budget:
                break
            budget -= self._chunk_of(self._admit_head(), plan)
        return plan

    def _chunk_of(self, e, plan: list[Chunk]) -> int:
        n = min(e.prompt_len - e.computed, self.chunk)
        last = e.computed + n == e.prompt_len
        plan.append(Chunk(e.sid, e.computed, n, prefill=True, last_of_prompt=last))
        e.computed += n
        if last and self.fold:
            plan.append(Chunk(e.sid, e.computed, 1, prefill=False, last_of_prompt=False))
            e.computed += 1
            n += 1
        return n


@dataclass
class _Launched:
    """A step whose decode rows are still on their way to the host."""

    sids: list[int]  # sampled rows (decode tokens, then prompt ends), in packed-row order
    host: torch.Tensor  # [B, K + 1] pinned view being filled
    done: torch.cuda.Event | None


class GpuEngine(Engine):
    kv_slack = LAG_SLACK  # a finished stream is scheduled once more (its row is ignored)

    def __init__(self, talker: torch.nn.Module, cfg: BackboneConfig, tokenizer: TokenizerLike,
                 cache: KVCache, config: EngineConfig | None = None, gpu: GpuEngineConfig | None = None,
                 fast: FastTalker | None = None, family: ModelFamily | None = None) -> None:
        """`fast`: an existing FastTalker over the same talker to share (its weights are not copied)."""
        super().__init__(talker, cfg, tokenizer, cache, config, family)
        self.gpu = gpu or GpuEngineConfig()
        dev = self.device
        if self.gpu.kernels == "fast" and dev.type != "cuda":
            raise KernelUnavailable(f"GpuEngine with kernels='fast' needs the model on CUDA, it is on {dev}")
        if fast is not None and (fast.k.name != self.gpu.kernels or fast.max_positions < self.max_seq_len + LAG_SLACK + 1):
            raise ConfigError("the shared FastTalker was built for other kernels or fewer positions")
        self.fast = fast or FastTalker(talker, self.gpu.kernels, max_positions=self.max_seq_len + LAG_SLACK + 1)
        alloc = cache.allocator
        alloc.reserve(SCRATCH_SEQ, 1)
        self.scratch_page = alloc.page_table(SCRATCH_SEQ)[0]
        # the scratch page is not the scheduler's to commit
        sched = replace(self.scheduler.config, num_pages=alloc.num_pages - 1)
        # a forced start row (v2's AUDIO_INIT column) is decoded in the prompt's last step
        self.scheduler = PrefillScheduler(sched, min(self.gpu.prefill_chunk, sched.token_budget - sched.max_batch - 1),
                                          fold_first_decode=not self.policy.sample_at_prompt_end)
        max_bucket = max(self.gpu.graph_buckets) if self.gpu.cuda_graphs else 0
        if self.gpu.cuda_graphs and max_bucket < self.config.max_batch:
            raise ConfigError(f"the largest graph bucket ({max_bucket}) must hold max_batch ({self.config.max_batch})")
        self.state = DeviceStreamState(self.config.max_batch, max_bucket, cfg.num_codebooks, cfg.codebook_size, dev,
                                       ras_window_max=self.gpu.ras_window_max,
                                       rules=self.family.device_rules(cfg), fast_noise=self.gpu.kernels == "fast")
        self._free_slots = list(range(self.config.max_batch - 1, -1, -1))
        self._slot: dict[int, int] = {}
        self._attn = self._eager_attention()
        self.graphs: DecodeGraphs | None = None
        if self.gpu.cuda_graphs:
            max_pages = self.config.max_batch * -(-self.max_seq_len // alloc.page_size) + 1
            self.graphs = DecodeGraphs(self.fast, self.state, cache.pool.k, cache.pool.v, self.scratch_page,
                                       alloc.page_size, min(max_pages, alloc.num_pages), self.gpu.graph_buckets)
            with torch.no_grad():
                self.graphs.capture()
        self.prefill_graphs: PrefillGraphs | None = None
        if self.gpu.kernels == "fast":  # the same padded body, replayed or (no graphs) run eagerly
            self.prefill_graphs = PrefillGraphs(self.fast, cache.pool.k, cache.pool.v, self.scratch_page,
                                                alloc.page_size, enabled=self.gpu.cuda_graphs)
            with torch.no_grad():
                self.prefill_graphs.capture()
        k = cfg.num_codebooks
        pin = dev.type == "cuda"
        self._host = [torch.zeros((self.config.max_batch, k + 1), dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._parity = 0
        self._inflight: _Launched | None = None
        self._staged: torch.cuda.Event | None = None  # the last step's host->device inputs were consumed
        self.wait_s = 0.0  # host time spent waiting for the device (benchmarks: host-bound or device-bound)
        self.replay_events: list | None = None  # benchmarks: (start, end) CUDA events around each decode replay
        self.last_prefill = 0  # prompt chunks in the last launched step

    @classmethod
    def from_pretrained(cls, model: str, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                        config: EngineConfig | None = None, gpu: GpuEngineConfig | None = None) -> GpuEngine:
        """A GPU engine for a checkpoint of any family (by config.json model_type, models/registry.py)."""
        from higgs_stream.engine.models.registry import load_model

        config = config or EngineConfig()
        talker, cfg, tokenizer = load_model(model, device=device, dtype=dtype, max_positions=config.max_seq_len)
        cache = KVCache.create(cfg, num_pages=config.kv_pages, page_size=config.page_size, dtype=talker.dtype,
                               device=device)
        return cls(talker, cfg, tokenizer, cache, config, gpu)

    def _eager_attention(self) -> FlashInferAttention | RefAttention:
        if self.gpu.kernels == "ref":
            return RefAttention(self.cfg.head_dim)
        try:
            return FlashInferAttention(self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim,
                                       self.cache.allocator.page_size, self.device, self.fast.dtype)
        except KernelUnavailableError as exc:
            raise KernelUnavailable(str(exc)) from exc

    # ------------------------------------------------------------------ public API (Engine's, plus the lag)
    def add(self, request: GenerationRequest) -> int:
        if isinstance(request, GenerationRequest) and request.sampling.ras_window > self.gpu.ras_window_max:
            raise InvalidInputError(f"ras_window {request.sampling.ras_window} exceeds this engine's maximum "
                                    f"{self.gpu.ras_window_max}")
        return super().add(request)

    def has_work(self) -> bool:
        return self._inflight is not None or super().has_work()

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        events = self._carry + self._admit_and_cancel()
        self._carry = []
        plan = self.scheduler.schedule()
        launched = self._launch(plan) if plan else None
        if self._inflight is not None:
            events += self._collect(self._inflight)
        self._inflight = launched
        self._deliver(events)
        return events

    # ------------------------------------------------------------------ stages
    def _launch(self, plan: list[Chunk]) -> _Launched | None:
        """Stage, run and start copying back one step; returns it (None: nothing sampled).

        Device order: each prompt chunk in its own forward (one sample-and-advance for the prompts
        that end, if the family samples there), then the decode rows (one graph replay, or one
        eager forward), which include the folded first decode token of the prompts that end."""
        if self._staged is not None:  # host staging buffers of the previous step are free again
            t0 = time.perf_counter()
            self._staged.synchronize()
            self.wait_s += time.perf_counter() - t0
        alloc = self.cache.allocator
        for c in plan:
            alloc.reserve(c.sid, c.end)  # within the scheduler's commitment
            self._holds_pages.add(c.sid)
        decode = [c for c in plan if not c.prefill]
        prefill = [c for c in plan if c.prefill]
        self.last_prefill = len(prefill)  # benchmarks' traces
        ends = [c for c in prefill if self._wants_audio(c)]  # prompt ends that are sampled
        self._start_streams([c for c in prefill if c.last_of_prompt])  # slots before any sampling
        parts: list[torch.Tensor] = []
        staged = None
        try:
            if prefill:
                first = self._prefill(prefill)
                if first is not None:
                    parts.append(first)
            if decode and self.graphs is not None:
                b = self._graph_stage(decode)
                staged = self._record_staged()  # before the replay: the next step stages while this one runs
                if self.replay_events is not None:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    parts.append(self.graphs.replay(b, len(decode)))
                    end.record()
                    self.replay_events.append((time.perf_counter(), len(decode), start, end))
                else:
                    parts.append(self.graphs.replay(b, len(decode)))
            elif decode:
                parts.append(self._eager_decode(decode))
        except Exception as exc:
            self._carry = [self._finish(self._streams[c.sid], "error", f"forward failed: {exc!r}")
                           for c in plan if c.sid in self._streams]
            raise
        self._staged = staged or self._record_staged()
        if not parts:
            return None
        packed = parts[0] if len(parts) == 1 else torch.cat(parts)  # [S, K + 1]
        host = self._host[self._parity][: packed.shape[0]]
        self._parity ^= 1
        host.copy_(packed, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _Launched([c.sid for c in ends + decode], host, done)

    def _kv_slot(self, table: list[int], pos: int) -> int:
        ps = self.cache.allocator.page_size
        return table[pos // ps] * ps + pos % ps

    def _graph_stage(self, decode: list[Chunk]) -> int:
        alloc = self.cache.allocator
        tables = [alloc.page_table(c.sid) for c in decode]
        return self.graphs.stage(
            positions=[c.start for c in decode],
            kv_slots=[self._kv_slot(t, c.start) for t, c in zip(tables, decode)],
            slots=[self._slot[c.sid] for c in decode],
            page_tables=tables, kv_lens=[c.end for c in decode],
        )

    def _record_staged(self) -> torch.cuda.Event | None:
        """An event after this step's host->device input copies (the host buffers are then free)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _plan_attention(self, tables: list[list[int]], kv_lens: list[int], qo_lens: list[int]) -> None:
        ps = self.cache.allocator.page_size
        if isinstance(self._attn, RefAttention):
            self._attn.plan_layout(PagedLayout.build(tables, kv_lens, qo_lens, ps, self.device))
        else:
            self._attn.plan(HostCSR.build(tables, kv_lens, qo_lens, ps), decode=max(qo_lens) == 1)

    def _eager_decode(self, decode: list[Chunk]) -> torch.Tensor:
        """The graph's body, eagerly, for exactly these rows: one all-audio forward + sampling."""
        alloc, dev = self.cache.allocator, self.device
        tables = [alloc.page_table(c.sid) for c in decode]
        t = lambda a: upload(a, dev, torch.long)
        slots = t([self._slot[c.sid] for c in decode])
        inp = FastInputs(text_ids=None, codes=self.state.last_col[slots], positions=t([c.start for c in decode]),
                         kv_slots=t([self._kv_slot(tb, c.start) for tb, c in zip(tables, decode)]),
                         out_rows=t(list(range(len(decode)))))
        self._plan_attention(tables, [c.end for c in decode], [1] * len(decode))
        logits = self.fast.forward(inp, self._attn, self.cache.pool.k, self.cache.pool.v)  # [D, K, V]
        return self.state.sample_and_advance(logits, slots, torch.ones(len(decode), dtype=torch.bool, device=dev))

    def _prefill(self, chunks: list[Chunk]) -> torch.Tensor | None:
        """Each prompt chunk in its own forward: an all-text first chunk through `PrefillGraphs`,
        others eagerly. Returns packed [E, K + 1] for the chunks whose last row is sampled (prompt
        ends, if the family samples there), else None."""
        alloc, dev = self.cache.allocator, self.device
        logits, slots = [], []
        for c in chunks:
            p = self._streams[c.sid].prompt
            table = alloc.page_table(c.sid)
            ids, codes, audio = p.input_ids[c.start:c.end], p.audio_codes[c.start:c.end], p.is_audio[c.start:c.end]
            kv_slots = [self._kv_slot(table, q) for q in range(c.start, c.end)]
            sampled = self._wants_audio(c)
            pg = self.prefill_graphs
            if pg is not None and c.start == 0 and c.num_tokens <= pg.max_len and not audio.any():
                out = pg.run(ids, kv_slots)  # [1, K, V], the graph's buffer
                if sampled:
                    logits.append(out.clone())
            else:
                out = self._eager_chunk(c, table, ids, codes, audio, kv_slots, sampled)
                if sampled:
                    logits.append(out)
            if sampled:
                slots.append(self._slot[c.sid])
        if not logits:
            return None
        sl = upload(slots, dev, torch.long)
        return self.state.sample_and_advance(torch.cat(logits), sl, torch.ones(len(slots), dtype=torch.bool, device=dev))

    def _eager_chunk(self, c: Chunk, table: list[int], ids: np.ndarray, codes: np.ndarray, audio: np.ndarray,
                     kv_slots: list[int], sampled: bool) -> torch.Tensor | None:
        """One prompt chunk of one sequence, eagerly: K/V, and the last row's logits when sampled."""
        dev = self.device
        t = lambda a: upload(a, dev)
        all_audio = bool(audio.all())
        inp = FastInputs(
            text_ids=None if all_audio else t(ids), codes=t(codes), positions=t(np.arange(c.start, c.end)),
            kv_slots=t(np.array(kv_slots, np.int64)),
            out_rows=t(np.array([c.num_tokens - 1] if sampled else [], np.int64)),
            audio_rows=None if all_audio else t(np.flatnonzero(audio)),
            text_rows=None if all_audio else t(np.flatnonzero(~audio)),
            select=None if all_audio else t(audio.astype(np.int32)),
        )
        self._plan_attention([table], [c.end], [c.num_tokens])
        if sampled:
            return self.fast.forward(inp, self._attn, self.cache.pool.k, self.cache.pool.v)  # [1, K, V]
        self.fast.hidden(inp, self._attn, self.cache.pool.k, self.cache.pool.v)
        return None

    def _start_streams(self, chunks: list[Chunk]) -> None:
        """AUDIO_INIT: give each stream a device slot (a forced start row is its writer's to know)."""
        starts = []
        for c in chunks:
            s = self._streams[c.sid]
            slot = self._free_slots.pop()
            self._slot[c.sid] = slot
            starts.append(StreamStart(slot, s.params, s.max_frames, s.prompt.audio_out))
        self.state.start(starts)

    def _collect(self, launched: _Launched) -> list[StepEvent]:
        """A launched step's rows, now on the host -> each stream's codec frames (its family's
        writer) and ends, in row order."""
        if launched.done is not None:
            t0 = time.perf_counter()
            launched.done.synchronize()
            self.wait_s += time.perf_counter() - t0
        k = self.cfg.num_codebooks
        rows = launched.host.numpy().tolist()  # [S, K + 1] plain ints: one conversion for the step
        out: list[StepEvent | tuple[int, int, bool, str | None]] = []  # (sid, frame index or -1, finished, reason)
        frames: list[list[int]] = []
        for sid, row in zip(launched.sids, rows):
            s = self._streams.get(sid)
            status = row[k]
            if s is None or status == IGNORED:  # finished, cancelled or failed meanwhile
                continue
            if status == ERROR:
                out.append(self._finish(s, "error", "non-finite audio logits"))
                continue
            finished = status != RUNNING
            frame = s.writer.push(row[:k], final=finished)
            if finished:
                self._release(s, STATUS_REASON[status])
            if frame is not None:
                frames.append(frame)
            if frame is not None or finished:
                out.append((sid, len(frames) - 1 if frame is not None else -1, finished, s.reason))
        table = np.array(frames, np.int64).reshape(len(frames), k)  # one array for every frame of the step
        return [e if isinstance(e, StepEvent) else StepEvent(e[0], table[e[1]] if e[1] >= 0 else None, e[2], e[3])
                for e in out]

    def _release(self, s: Stream, reason: str, error: str | None = None) -> None:
        slot = self._slot.pop(s.sid, None)
        if slot is not None:
            self.state.release(slot)
            self._free_slots.append(slot)
        super()._release(s, reason, error)


def load_engine(model: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                config: EngineConfig | None = None, cuda_graphs: bool = True, kernels: str = "fast") -> Engine:
    """The engine `serve` and `synth` run: on CUDA the fast path (`GpuEngine`: Triton + FlashInfer
    kernels, decode steps replayed from CUDA graphs unless `cuda_graphs=False`), bf16 unless
    `dtype` says otherwise; elsewhere the plain `Engine` in fp32 (or `dtype`)."""
    if torch.device(device).type == "cuda":
        return GpuEngine.from_pretrained(model, device=device, dtype=dtype or torch.bfloat16, config=config,
                                         gpu=GpuEngineConfig(cuda_graphs=cuda_graphs and kernels == "fast",
                                                             kernels=kernels))
    if not cuda_graphs:
        log.info("--no-cuda-graphs has no effect on %s", device)
    return Engine.from_pretrained(model, device=device, dtype=dtype or torch.float32, config=config)
