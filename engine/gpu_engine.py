"""The engine's GPU path: the same API and scheduling as `Engine`, with the step on the device.

    schedule -> stage inputs -> forward (graph replay on decode-only steps) -> sample + advance
             -> one async copy of the new columns -> (next call) hand the columns out

Per-stream generation state (last column, delay/EOS counters, RAS window, seeds, sampling
parameters) lives in `DeviceStreamState`, so a decode step feeds its own output back without the
host. The host runs one step ahead of its results: `step()` launches step t, then waits for step
t-1's columns (already copied to pinned memory while step t ran) and turns them into events. A
stream that finished at t-1 is therefore scheduled once more at t; the device ignores that row
(and the scheduler's KV commitment has one position of slack for it).

Decode-only steps replay a CUDA graph per batch bucket (engine/cuda_graph.py); steps with prompt
chunks run eagerly with FlashInfer's paged prefill. `GpuEngineConfig(kernels="ref",
cuda_graphs=False)` runs the identical step logic with the plain-torch kernels on any device: on
the CPU, in fp32, it reproduces the CPU engine's greedy codes (tests/engine/test_gpu_engine.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from higgs_stream.engine.config import TalkerConfig
from higgs_stream.engine.config_v3 import TalkerV3Config
from higgs_stream.engine.cuda_graph import DEFAULT_BUCKETS, DecodeGraphs
from higgs_stream.engine.engine import Engine, EngineConfig, StepEvent
from higgs_stream.engine.errors import ConfigError, InvalidInputError
from higgs_stream.engine.fast_talker import FastInputs, FastTalker, KernelUnavailable
from higgs_stream.engine.generation import Stream
from higgs_stream.engine.gpu_sampling import ERROR, IGNORED, RUNNING, STATUS_REASON, DeviceStreamState, StreamStart
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_registry import family_of, load_model
from higgs_stream.engine.prompt import TokenizerLike
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.scheduler import Chunk, Scheduler
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

    def __post_init__(self) -> None:
        if self.kernels not in ("fast", "ref"):
            raise ConfigError(f"kernels must be 'fast' or 'ref', got {self.kernels!r}")
        if self.cuda_graphs and self.kernels != "fast":
            raise ConfigError("cuda_graphs need kernels='fast'")
        if not self.graph_buckets or min(self.graph_buckets) < 1:
            raise ConfigError(f"graph_buckets must be positive, got {self.graph_buckets}")
        if self.ras_window_max < 1:
            raise ConfigError(f"ras_window_max must be >= 1, got {self.ras_window_max}")


@dataclass
class _Launched:
    """A step whose decode rows are still on their way to the host."""

    sids: list[int]  # decode rows, in packed-row order
    host: torch.Tensor  # [B, K + 1] pinned view being filled
    done: torch.cuda.Event | None


class GpuEngine(Engine):
    def __init__(self, talker: torch.nn.Module, cfg: TalkerConfig | TalkerV3Config, tokenizer: TokenizerLike,
                 cache: KVCache, config: EngineConfig | None = None, gpu: GpuEngineConfig | None = None,
                 fast: FastTalker | None = None) -> None:
        """`fast`: an existing FastTalker over the same talker to share (its weights are not copied)."""
        super().__init__(talker, cfg, tokenizer, cache, config)
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
        self.scheduler = Scheduler(replace(self.scheduler.config, num_pages=alloc.num_pages - 1))
        max_bucket = max(self.gpu.graph_buckets) if self.gpu.cuda_graphs else 0
        if self.gpu.cuda_graphs and max_bucket < self.config.max_batch:
            raise ConfigError(f"the largest graph bucket ({max_bucket}) must hold max_batch ({self.config.max_batch})")
        self.state = DeviceStreamState(self.config.max_batch, max_bucket, cfg.num_codebooks, cfg.codebook_size, dev,
                                       ras_window_max=self.gpu.ras_window_max,
                                       fast_noise=self.gpu.kernels == "fast", family=family_of(cfg))
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
        k = cfg.num_codebooks
        pin = dev.type == "cuda"
        self._host = [torch.zeros((self.config.max_batch, k + 1), dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._parity = 0
        self._inflight: _Launched | None = None
        self._staged: torch.cuda.Event | None = None  # the last step's host->device inputs were consumed

    @classmethod
    def from_pretrained(cls, model: str, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                        config: EngineConfig | None = None, gpu: GpuEngineConfig | None = None) -> GpuEngine:
        """A GPU engine for a v2 or v3 checkpoint (by config.json model_type, model_registry.load_model)."""
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
        launched, init_events = self._launch(plan) if plan else (None, [])
        if self._inflight is not None:
            events += self._collect(self._inflight)
        self._inflight = launched
        events += init_events
        self._deliver(events)
        return events

    # ------------------------------------------------------------------ stages
    def _admit_and_cancel(self) -> list[StepEvent]:
        while self._pending:
            stream = self._pending.popleft()
            self.scheduler.add(stream.sid, stream.prompt_len, stream.max_kv_tokens + LAG_SLACK)
            self._streams[stream.sid] = stream
        events = []
        while self._cancels:
            sid = self._cancels.popleft()
            if sid in self._streams:
                events.append(self._finish(self._streams[sid], "cancelled"))
        return events

    def _launch(self, plan: list[Chunk]) -> tuple[_Launched | None, list[StepEvent]]:
        """Stage, run and start copying back one step; returns it and its AUDIO_INIT events."""
        if self._staged is not None:  # host staging buffers of the previous step are free again
            self._staged.synchronize()
        alloc = self.cache.allocator
        for c in plan:
            alloc.reserve(c.sid, c.end)  # within the scheduler's commitment
            self._holds_pages.add(c.sid)
        sampled = [c for c in plan if self._wants_audio(c)]  # decode tokens, and v3's prompt ends
        init_events = self._start_streams([c for c in plan if c.prefill and c.last_of_prompt])  # before sampling
        try:
            if self.graphs is not None and not any(c.prefill for c in plan):
                packed = self._graph_step(sampled)
            else:
                packed = self._eager_step(plan, sampled)
        except Exception as exc:
            self._carry = [self._finish(self._streams[c.sid], "error", f"forward failed: {exc!r}")
                           for c in plan if c.sid in self._streams]
            raise
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        if not sampled:
            return None, init_events
        host = self._host[self._parity][: len(sampled)]
        self._parity ^= 1
        host.copy_(packed, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return _Launched([c.sid for c in sampled], host, done), init_events

    def _kv_slot(self, table: list[int], pos: int) -> int:
        ps = self.cache.allocator.page_size
        return table[pos // ps] * ps + pos % ps

    def _graph_step(self, decode: list[Chunk]) -> torch.Tensor:
        alloc = self.cache.allocator
        tables = [alloc.page_table(c.sid) for c in decode]
        return self.graphs.run(
            positions=[c.start for c in decode],
            kv_slots=[self._kv_slot(t, c.start) for t, c in zip(tables, decode)],
            slots=[self._slot[c.sid] for c in decode],
            page_tables=tables, kv_lens=[c.end for c in decode],
        )

    def _eager_step(self, plan: list[Chunk], sampled: list[Chunk]) -> torch.Tensor | None:
        """A ragged forward over prompt chunks and decode tokens; samples the `sampled` chunks' last rows."""
        alloc, k, dev = self.cache.allocator, self.cfg.num_codebooks, self.device
        ids, codes, is_audio, positions, kv_slots, decode_rows, out_rows = [], [], [], [], [], [], []
        tables = [alloc.page_table(c.sid) for c in plan]
        row = 0
        for c, table in zip(plan, tables):
            if c.prefill:
                p = self._streams[c.sid].prompt
                ids.append(p.input_ids[c.start:c.end])
                codes.append(p.audio_codes[c.start:c.end])
                is_audio.append(p.is_audio[c.start:c.end])
            else:
                ids.append(np.array([self.policy.continuation_id], np.int64))
                codes.append(np.zeros((1, k), np.int64))  # replaced by the device's last column
                is_audio.append(np.ones(1, bool))
                decode_rows.append(row)
            if self._wants_audio(c):
                out_rows.append(row + c.num_tokens - 1)
            positions.append(np.arange(c.start, c.end, dtype=np.int64))
            kv_slots.append(np.array([self._kv_slot(table, p) for p in range(c.start, c.end)], np.int64))
            row += c.num_tokens
        audio = np.concatenate(is_audio)
        codes_dev = torch.from_numpy(np.concatenate(codes)).to(dev)  # [N, K]
        if decode_rows:  # decode tokens feed back the device's last column
            fed = torch.tensor([self._slot[c.sid] for c in plan if not c.prefill], dtype=torch.long, device=dev)
            codes_dev[torch.tensor(decode_rows, dtype=torch.long, device=dev)] = self.state.last_col[fed]
        slots = torch.tensor([self._slot[c.sid] for c in sampled], dtype=torch.long, device=dev)
        rows = torch.tensor(out_rows, dtype=torch.long, device=dev)
        all_audio = bool(audio.all())
        inp = FastInputs(
            text_ids=None if all_audio else torch.from_numpy(np.concatenate(ids)).to(dev),
            codes=codes_dev, positions=torch.from_numpy(np.concatenate(positions)).to(dev),
            kv_slots=torch.from_numpy(np.concatenate(kv_slots)).to(dev), out_rows=rows,
            audio_rows=None if all_audio else torch.from_numpy(np.flatnonzero(audio)).to(dev),
            text_rows=None if all_audio else torch.from_numpy(np.flatnonzero(~audio)).to(dev),
            select=None if all_audio else torch.from_numpy(audio.astype(np.int32)).to(dev),
        )
        qo_lens, kv_lens = [c.num_tokens for c in plan], [c.end for c in plan]
        if isinstance(self._attn, RefAttention):
            self._attn.plan_layout(PagedLayout.build(tables, kv_lens, qo_lens, alloc.page_size, dev))
        else:
            self._attn.plan(HostCSR.build(tables, kv_lens, qo_lens, alloc.page_size), decode=max(qo_lens) == 1)
        if not sampled:  # prompt chunks only: K/V written, no logits needed
            self.fast.hidden(replace(inp, out_rows=inp.out_rows[:0]), self._attn, self.cache.pool.k, self.cache.pool.v)
            return None
        logits = self.fast.forward(inp, self._attn, self.cache.pool.k, self.cache.pool.v)  # [S, K, V]
        return self.state.sample_and_advance(logits, slots, torch.ones(len(sampled), dtype=torch.bool, device=dev))

    def _start_streams(self, chunks: list[Chunk]) -> list[StepEvent]:
        """AUDIO_INIT: give each stream a device slot and emit its all-BOS column."""
        starts, events = [], []
        for c in chunks:
            s = self._streams[c.sid]
            slot = self._free_slots.pop()
            self._slot[c.sid] = slot
            starts.append(StreamStart(slot, s.params, s.max_frames, s.prompt.audio_out))
            events.append(StepEvent(s.sid, np.full(self.cfg.num_codebooks, self.cfg.codebook_size, np.int64), False))
        self.state.start(starts)
        return events

    def _collect(self, launched: _Launched) -> list[StepEvent]:
        if launched.done is not None:
            launched.done.synchronize()
        packed = launched.host.numpy()
        k, events = self.cfg.num_codebooks, []
        for sid, row in zip(launched.sids, packed):
            s = self._streams.get(sid)
            status = int(row[k])
            if s is None or status == IGNORED:  # finished, cancelled or failed meanwhile
                continue
            if status == ERROR:
                events.append(self._finish(s, "error", "non-finite audio logits"))
                continue
            column = row[:k].copy()
            if status == RUNNING:
                events.append(StepEvent(sid, column, finished=False))
            else:
                self._release(s, STATUS_REASON[status])
                if self.state.closing_column is not None:  # v3: the last row, then the all-EOC column
                    events.append(StepEvent(sid, column, finished=False))
                    column = self.state.closing_column.copy()
                events.append(StepEvent(sid, column, finished=True, reason=s.reason))
        return events

    def _release(self, s: Stream, reason: str, error: str | None = None) -> None:
        slot = self._slot.pop(s.sid, None)
        if slot is not None:
            self.state.release(slot)
            self._free_slots.append(slot)
        super()._release(s, reason, error)


def load_engine(model: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                config: EngineConfig | None = None, cuda_graphs: bool = True) -> Engine:
    """The engine `serve` and `synth` run: on CUDA the fast path (`GpuEngine`: Triton + FlashInfer
    kernels, decode steps replayed from CUDA graphs unless `cuda_graphs=False`), bf16 unless
    `dtype` says otherwise; elsewhere the plain `Engine` in fp32 (or `dtype`)."""
    if torch.device(device).type == "cuda":
        return GpuEngine.from_pretrained(model, device=device, dtype=dtype or torch.bfloat16, config=config,
                                         gpu=GpuEngineConfig(cuda_graphs=cuda_graphs))
    if not cuda_graphs:
        log.info("--no-cuda-graphs has no effect on %s", device)
    return Engine.from_pretrained(model, device=device, dtype=dtype or torch.float32, config=config)
