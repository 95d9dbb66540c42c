"""The model runner: one step of every scheduled sequence on the device, for any model family.

    stage inputs -> forward (graph replay on decode-only steps) -> sample + the family's row rules
    -> one async copy of the new rows -> (next call) the rows, for the engine's writers

`Runner` (runner.py) is what the engine (engine.py) calls; two implement it, the way kernels/ keeps a plain
`*_ref` beside each fast kernel:

* `ModelRunner` (this module): the fast path. Per-stream generation state (last row, ramp/EOS
  counters, RAS window, seeds, sampling parameters) lives on the device (`DeviceStreamState`, the
  family's `DeviceRules`), so a decode step feeds its own output back without the host, and a
  decode step can replay a CUDA graph. `ModelRunnerConfig(kernels="ref", cuda_graphs=False)` runs
  the identical step logic with the plain-torch kernels on any device.
* `RefRunner` (ref_runner.py): the plain-torch reference: the talker's own `forward`, sampling
  with per-stream generators, and the family's host rule machines; the oracle the fast path's
  tests compare against, and the CPU path.

The host runs one step ahead of the device's results: `run()` launches step t, then waits for step
t-1's rows (already copied to pinned memory while step t ran) and returns them (launch_queue.py keeps the
launches in flight). A sequence that finished at t-1 is therefore scheduled once more at t; the device
ignores that row (and the KV commitment has one position of slack for it, `kv_slack`).

Decode rows replay a CUDA graph per batch bucket (engine/cuda_graph.py), also in steps that
prefill other sequences. Prompts are cut at multiples of `ModelRunnerConfig.prefill_chunk` tokens
whatever else is running (scheduler.PrefillScheduler). A first chunk that is all text (e.g. a Higgs
v2 prompt without reference or history), or any first chunk of a family that embeds its own rows
(Qwen3-TTS), replays a prefill graph per length bucket (`PrefillGraphs`), up to
`ModelRunnerConfig.prefill_pack` first chunks packed into one replay (a burst of arrivals reads the
weights once per pack, not once per prompt); other chunks run eagerly with FlashInfer's paged
prefill, one per forward. With `prefill_pack=1` a sequence's K/V and logits do not depend on what
shares its steps: with batch-invariant decode steps, greedy codes of streams served together equal
each stream served alone (packed, they equal them to fp rounding). The rows that end prompts are sampled
(and completed) by one graph replay per count bucket (`PromptEndGraphs`).
A family whose prompt end yields a forced start row instead of a sample (`sample_at_prompt_end`
False: Higgs v2's AUDIO_INIT) has that step folded into the prompt's last step: the first decode
token (the start row, at the position after the prompt) joins the same step's decode rows, after
the prefill on the device. The first sampled row so comes one step earlier; the codes are the
same function of the same inputs. On the CPU, in fp32, with the plain-torch kernels it reproduces
the reference runner's greedy codes (tests/engine/test_model_runner.py).

Late prompts (`EngineConfig.late_prompts`, families that sample at the prompt end): the host runs a
step ahead, so a prompt that arrives while the device runs step t would wait for step t + 1 (already
queued) and then ride in step t + 2 behind every stream's decode. Instead, while the host waits for
step t, a prompt that arrives is prefilled (and its first row sampled and completed) in a launch of
its own queued right behind step t + 1: its first frame comes one decode step sooner, and the device
does the same work in the same order otherwise. Every wait takes them (a prompt arriving after another's
late launch, or while the engine holds, gets a launch of its own too), but at most `LATE_PER_STEP`
between two regular launches (launch_queue.py: arrivals cannot hold decode steps back for long), and a regular
step is launched only while at most one launch is in flight, so a sequence is still scheduled at most once after
its end (`LAG_SLACK`). The engine offers none while its newest regular step carries prompt chunks (unless
`EngineConfig.late_prompts_in_bursts`): in a burst of arrivals they ride the next regular step, packed.

A family whose head samples fewer codebooks than a row holds (Qwen3-TTS: group 0 of 16) has each
sampled row completed on the device inside the same step (`FastWeights.complete_rows`, its code
predictor: 15 sub-steps), so its graphed decode step is a whole frame; its rows embed through the
family's `FastWeights.embed_rows` (text track + codec track), and each decode row stages its prompt's
next text-track id.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from higgs_stream.engine.cuda_graph import (DEFAULT_BUCKETS, PROMPT_END_BUCKETS, DecodeGraphs, FirstChunk,
                                             PrefillGraphs, PromptEndGraphs, decode_step, graph_buckets_for)
from higgs_stream.engine.device_copy import upload
from higgs_stream.engine.errors import ConfigError, InvalidInputError
from higgs_stream.engine.family import GenerationPolicy, ModelFamily
from higgs_stream.engine.fast_talker import (BF16_GEMV_ROWS, CUDA_CORE_GEMV_ROWS, FUSE_FP8_QUANT, FastInputs,
                                             FastTalker, KernelUnavailable)
from higgs_stream.engine.gemv_choice import GemvChoice
from higgs_stream.engine.gpu_sampling import DeviceStreamState, StreamStart
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.launch_queue import Launched, LaunchQueue
from higgs_stream.engine.quantize import check_fp8_device
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.runner import LateCall, RowOut, samples_at
from higgs_stream.engine.scheduler import Chunk, PrefillScheduler, SchedulerConfig
from higgs_stream.engine.sequence import Sequence
from higgs_stream.engine.talker_config import BackboneConfig
from higgs_stream.kernels._triton import KernelUnavailableError
from higgs_stream.kernels.int8_linear import GEMV_ROWS_MAX
from higgs_stream.kernels.attention import FP8_KV, PagedLayout
from higgs_stream.kernels.flashinfer_attention import FlashInferAttention, HostCSR, RefAttention

# ModelRunnerConfig.pdl_max_rows when not given (`default_pdl_max_rows`): bf16 and quantized talkers. H200, v2, the
# replayed step with PDL vs without, same call (session 23): bf16 1-32 rows 0.7-2.8 % faster (2.45 vs 2.52 ms at one
# row, 3.02 vs 3.10 at 32), 64 the same, 128 +0.9 %, 256 +2.6 %; fp8 + e4m3 pages 1 row 1.62 vs 1.77, 2 rows 2.22 vs
# 2.33 (the CUDA-core GEMV), but the 16-row graph (3-16 rows: the fp8 linears' Triton kernels) 2.84 vs 2.64 and
# 128-256 rows +2-4 %. int8 as fp8 (the same GEMV at 1-2 rows; not timed). A family whose step does not gain sets
# `decode_pdl = False` (Qwen3-TTS)
PDL_MAX_ROWS_BF16, PDL_MAX_ROWS_QUANTIZED = 32, 2
MAX_PREFILL_PACK = 32  # prompts per prefill replay: at most the smallest prefill bucket
SCRATCH_SEQ = -1  # allocator id of the page padded graph rows write into
LAG_SLACK = 1  # extra KV positions a stream may be scheduled for after it finished (one step of lag)

log = logging.getLogger(__name__)


def _text_ids(decode: list[Chunk]) -> list[int]:
    """Each decode row's text-track id (family.Prompt.step_text_id of its step)."""
    return [c.seq.prompt.step_text_id(c.start - c.seq.prompt_len) for c in decode]


# ------------------------------------------------------------------------------ the fast path
@dataclass(frozen=True)
class ModelRunnerConfig:
    kernels: str = "fast"  # "fast" (Triton + FlashInfer, CUDA) | "ref" (plain torch, any device)
    cuda_graphs: bool = True  # replay decode-only steps from captured graphs (needs kernels="fast")
    graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    ras_window_max: int = 16  # longest RAS window a request may ask for
    prefill_chunk: int = 512  # prompt tokens per prefill forward (capped by token_budget - max_batch)
    prefill_pack: int = 8  # first chunks per prefill replay (1: one prompt per forward, batch-invariant prefill)
    # decode graphs of at least this many rows over bf16/fp16 K/V pages run FlashInfer's tensor-core decode (None:
    # never). H100, v2's heads, 300 tokens (scripts/bench_attention.py): 130 vs 145 us per layer at 256 rows, 43 vs
    # 39 at 64; over fp8 pages slower at every batch (152 vs 120 at 256). Whole v2 decode step (bench_quant, same
    # call): 256 rows 8.04 vs 8.39 ms replayed, but 192 rows 6.97 vs 6.39 and 128 rows 5.59 vs 5.25. Off by default:
    # FlashInfer compiles the tensor-core kernel at start-up on a machine without its JIT cache (a v2 server took 72 s
    # to be ready with it at 256, 36 s without, H100s), for 4 % of a step in the largest bucket only; 256 to use it
    tensor_core_decode_from: int | None = None
    # decode graphs of at least this many rows attend with our Triton kernel (kernels/paged_decode.py; None: never,
    # FlashInfer's decode everywhere; wins over tensor_core_decode_from). H100, v2's heads, per layer, 300 tokens,
    # ours vs FlashInfer's best: bf16 pages 32 / 112 us vs 39 / 130 at 64 / 256 rows, e4m3 pages 25 / 85 vs 45 / 114
    triton_decode_from: int | None = 64
    # the smaller decode graphs and the eager decode steps run the Triton kernel's ranged form (fixed 64-token ranges
    # reduced on their own, then merged: batch-invariant, the same bits in any batch below triton_decode_from and
    # eagerly) instead of FlashInfer's CUDA-core decode (session 14's ranges followed the batch and codes then
    # changed with the bucket). Whole v2 steps replayed, H100, same call (session 15), ranged vs FlashInfer: bf16 1 /
    # 2 / 4 / 16 rows 3.12 / 3.16 / 3.21 / 3.52 vs 3.32 / 3.32 / 3.36 / 3.58 ms; fp8 + e4m3 pages 2.00 / 2.48 / 2.89 /
    # 2.74 vs 2.12 / 2.61 / 3.03 / 2.89; 32 rows equal. GPU-tested: equal codes batched and alone, replayed and eager.
    # Off with triton_decode_from None. Eager decode steps pick their kernel as the graphs do (decode_kernel), so from
    # triton_decode_from rows they run the whole form (since session 15's last commit; GPU-tested before it: the
    # ranged eager path, and the whole form in the graphs)
    triton_ranged_decode: bool = True
    # fp8 weights (--quantize fp8), more than 16 rows: the norms and the SiLU write their linear's per-token e4m3
    # activations (FastTalker's fuse_fp8_quant): 84 fewer launches a v2 step. The same logits (GPU test). Timed on
    # H100s, fp8 + e4m3 pages, replayed, three A/B pairs in two calls (session 15, the SiLU reading its row once):
    # 256 rows 5.78 vs 5.97, 5.84 vs 5.97, 5.85 vs 5.98 ms; 64 rows 3.55 vs 3.62, 3.53 vs 3.62, 3.54 vs 3.61: on
    fuse_fp8_quant: bool = FUSE_FP8_QUANT
    # quantized talkers (fp8, int8), decode steps of at most this many rows (<= 4): the linears (Qwen3-TTS's code
    # predictor's too) on a CUDA-core GEMV (kernels/int8_linear.py triton_gemv: wide K tiles, fp32 sums on CUDA
    # cores) instead of the tensor-core kernel (at batch 1 its o / down projections took 9.4 / 18.6 us against 3.1 /
    # 8.4 of reading). H100, v2, fp8 + e4m3 pages, replayed, same call: 1 row 2.12 vs 2.55 ms, 2 rows 2.60 vs 2.89,
    # but 4 rows 3.64 vs 2.97 (its rows are unrolled reductions): 2. A row's sums do not depend on the other row,
    # but do differ from the tensor-core kernel's: a quantized stream's codes are the same in batches of 1-2 and in
    # batches of 3-16, not across (bf16 talkers: unaffected). 0: never
    cuda_core_gemv_rows: int = CUDA_CORE_GEMV_ROWS
    # plain (bf16) linears of at most this many rows (<= 4): on the CUDA-core GEMV for each weight shape whose times at
    # 1..N rows, measured at load on this device, summed to at most 85 % of cuBLAS's (engine/gemv_choice.py; the
    # talker's and Qwen3-TTS's code predictor's layers and the predictor's input projection). H200 (session 25): the code
    # predictor's o and input projections (N 1024, K 2048) 12.9 -> 5.6 us at one row, 8.5 -> 5.3 at four. 0: never
    bf16_gemv_rows: int = BF16_GEMV_ROWS
    # CUDA, compute capability 9.0+ (older devices: never): the decode graphs of at most this many rows launch their
    # Triton kernels with programmatic dependent launch (kernels/_triton.py: each may start while the kernel before
    # it ends, and waits for it before reading or writing anything: the same logits, launch latency hidden). H200,
    # v2, replayed, same call (session 23): one row 1.60 vs 1.76 ms (fp8 + e4m3 pages), 2.47 vs 2.54 (bf16); 128-256
    # rows 2-4 % slower. None: the talker's default (`default_pdl_max_rows`); 0: never
    pdl_max_rows: int | None = None
    # CUDA, fast kernels: the family's row rules past the float math (RowRules.fuse: Higgs v2 / v3) compiled by
    # torch.compile into a few fused kernels. H200, v2 (scripts/bench_rules.py, session 31): the sample-and-advance
    # graph 188 -> 64 us at one row, 219 -> 85 at 16, 377 -> 189 at 256 (129 -> 31-36 kernels); the same integers
    # (no float op is compiled). Costs its compiles at start-up (~20 s on an empty Inductor cache, H200)
    fuse_rules: bool = True

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
        if not 1 <= self.prefill_pack <= MAX_PREFILL_PACK:
            raise ConfigError(f"prefill_pack must be in 1..{MAX_PREFILL_PACK}, got {self.prefill_pack}")
        if self.pdl_max_rows is not None and self.pdl_max_rows < 0:
            raise ConfigError(f"pdl_max_rows must be >= 0, got {self.pdl_max_rows}")
        for name in ("cuda_core_gemv_rows", "bf16_gemv_rows"):
            if not 0 <= getattr(self, name) <= GEMV_ROWS_MAX:
                raise ConfigError(f"{name} must be in 0..{GEMV_ROWS_MAX}, got {getattr(self, name)}")
        for name in ("tensor_core_decode_from", "triton_decode_from"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 or None, got {getattr(self, name)}")


def default_pdl_max_rows(family: ModelFamily, quantized: bool) -> int:
    """ModelRunnerConfig.pdl_max_rows when not given: 0 for a family that declares `decode_pdl = False`, else
    PDL_MAX_ROWS_QUANTIZED for a quantized talker (int8, fp8), PDL_MAX_ROWS_BF16 for a plain one."""
    if not getattr(family, "decode_pdl", True):
        return 0
    return PDL_MAX_ROWS_QUANTIZED if quantized else PDL_MAX_ROWS_BF16


def runner_config(quantize: str, cuda_graphs: bool = True, kernels: str = "fast",
                  options: Mapping[str, Any] | None = None) -> ModelRunnerConfig:
    """The ModelRunnerConfig `serve` and `synth` run for a talker quantized with `quantize`: graphs only with the fast
    kernels, the decode graphs' buckets for that quantization (`graph_buckets_for`) unless `options` (the config's
    other fields) name some."""
    opts = {"graph_buckets": graph_buckets_for(quantize), **(options or {})}
    return ModelRunnerConfig(cuda_graphs=cuda_graphs and kernels == "fast", kernels=kernels, **opts)


class ModelRunner:
    kv_slack = LAG_SLACK  # a finished sequence is scheduled once more (its row is ignored)

    def __init__(self, talker: torch.nn.Module, cfg: BackboneConfig, cache: KVCache, policy: GenerationPolicy,
                 family: ModelFamily, max_batch: int, max_seq_len: int, config: ModelRunnerConfig | None = None,
                 fast: FastTalker | None = None) -> None:
        """`fast`: an existing FastTalker over the same talker to share (its weights are not copied)."""
        completes = policy.head_codebooks < cfg.num_codebooks  # the talker completes rows (family.RowCompleter)
        self.config = config or ModelRunnerConfig()
        self.cfg, self.cache, self.policy = cfg, cache, policy
        self.device = dev = next(talker.parameters()).device
        if self.config.kernels == "fast" and dev.type != "cuda":
            raise KernelUnavailable(f"the model runner with kernels='fast' needs the model on CUDA, it is on {dev}")
        positions = max_seq_len + LAG_SLACK + 1
        fast_only = (lambda v: v if self.config.kernels == "fast" else 0)  # noqa: E731
        if fast is not None and (fast.k.name != self.config.kernels or fast.max_positions < positions
                                 or fast.fuse_fp8 != (self.config.fuse_fp8_quant and self.config.kernels == "fast")
                                 or fast.cuda_core_gemv_rows != fast_only(self.config.cuda_core_gemv_rows)
                                 or fast.bf16_gemv_rows != fast_only(self.config.bf16_gemv_rows)):
            raise ConfigError("the shared FastTalker was built for other kernels, fewer positions, another "
                              "fuse_fp8_quant, cuda_core_gemv_rows or bf16_gemv_rows")
        if cache.pool.k.dtype == FP8_KV and self.config.kernels == "fast":
            check_fp8_device(dev, "--kv-cache-dtype fp8")  # Triton's e4m3 stores, FlashInfer's fp8 pages
        self.fast = fast or FastTalker(talker, self.config.kernels, max_positions=positions,
                                       fuse_fp8_quant=self.config.fuse_fp8_quant,
                                       cuda_core_gemv_rows=self.config.cuda_core_gemv_rows,
                                       bf16_gemv_rows=self.config.bf16_gemv_rows)
        # the decode graphs captured with programmatic dependent launch: up to this many rows (0: none)
        self.pdl_max_rows = 0
        if self.config.cuda_graphs and torch.cuda.get_device_capability(dev) >= (9, 0):
            rows = self.config.pdl_max_rows
            self.pdl_max_rows = default_pdl_max_rows(family, self.fast.quantized) if rows is None else rows
        if completes and self.fast.complete_rows is None:
            raise ConfigError(f"{family.name} samples {policy.head_codebooks} of {cfg.num_codebooks} codebooks per row "
                              f"but its talker has no complete_rows for the fast path (FastWeights.complete_rows)")
        alloc = cache.allocator
        alloc.reserve(SCRATCH_SEQ, 1)
        self.scratch_page = alloc.page_table(SCRATCH_SEQ)[0]
        max_bucket = max(self.config.graph_buckets) if self.config.cuda_graphs else 0
        if self.config.cuda_graphs and max_bucket < max_batch:
            raise ConfigError(f"the largest graph bucket ({max_bucket}) must hold max_batch ({max_batch})")
        scratch = max(max_bucket, PROMPT_END_BUCKETS[-1]) if self.config.cuda_graphs else 0  # padded rows' slots
        self.state = DeviceStreamState(max_batch, scratch, cfg.num_codebooks, cfg.codebook_size, dev,
                                       ras_window_max=self.config.ras_window_max,
                                       rules=family.device_rules(cfg), fast_kernels=self.config.kernels == "fast",
                                       vocab=cfg.audio_vocab, complete=self.fast.complete_rows if completes else None,
                                       fuse_rules=self.config.fuse_rules and self.config.kernels == "fast"
                                       and dev.type == "cuda")
        if self.config.cuda_graphs:
            with torch.no_grad():
                self.state.capture_start()
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._attn = self._eager_attention()
        self.graphs: DecodeGraphs | None = None
        if self.config.cuda_graphs:
            max_pages = max_batch * -(-max_seq_len // alloc.page_size) + 1
            self.graphs = DecodeGraphs(self.fast, self.state, cache.pool.k, cache.pool.v, self.scratch_page,
                                       alloc.page_size, min(max_pages, alloc.num_pages), self.config.graph_buckets,
                                       tensor_core_from=self.config.tensor_core_decode_from,
                                       triton_from=self.config.triton_decode_from,
                                       ranged_below=self.config.triton_ranged_decode,
                                       pdl_max_rows=self.pdl_max_rows)
            with torch.no_grad():
                self.graphs.capture()
        self.prompt_ends: PromptEndGraphs | None = None  # the sampling (and row completion) of prompt ends
        if self.config.cuda_graphs:
            v = self.fast.cfg.audio_vocab
            head = (self.fast.audio_head.shape[0] // v, v)  # audio_logits' [h, V]
            self.prompt_ends = PromptEndGraphs(self.state, cfg.hidden_size, head, self.fast.dtype)
            with torch.no_grad():
                self.prompt_ends.capture()
        self.prefill_graphs: PrefillGraphs | None = None
        # the same padded body, replayed or (no graphs) run eagerly
        if self.config.kernels == "fast":
            self.prefill_graphs = PrefillGraphs(self.fast, cache.pool.k, cache.pool.v, self.scratch_page,
                                                alloc.page_size, enabled=self.config.cuda_graphs,
                                                max_prompts=self.config.prefill_pack)
            with torch.no_grad():
                self.prefill_graphs.capture()
        self.queue = LaunchQueue(dev, max_batch, cfg.num_codebooks, self._launch_prompts)  # launches in flight
        self._staged: torch.cuda.Event | None = None  # the last step's host->device inputs were consumed
        self.replay_events: list | None = None  # benchmarks: (start, end) CUDA events around each decode replay
        self.last_prefill = 0  # prompt chunks in the last launched step

    def _eager_attention(self) -> FlashInferAttention | RefAttention:
        if self.config.kernels == "ref":
            return RefAttention(self.cfg.head_dim)
        try:
            return FlashInferAttention(self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim,
                                       self.cache.allocator.page_size, self.device, self.fast.dtype,
                                       kv_dtype=self.cache.pool.k.dtype, triton_from=self.config.triton_decode_from,
                                       ranged_max_kv_len=self.fast.max_positions
                                       if self.config.triton_ranged_decode else None)
        except KernelUnavailableError as exc:
            raise KernelUnavailable(str(exc)) from exc

    # ------------------------------------------------------------------ the engine's calls
    def make_scheduler(self, config: SchedulerConfig) -> PrefillScheduler:
        # the scratch page is not the scheduler's to commit; a forced start row (v2's AUDIO_INIT
        # column) is decoded in the prompt's last step
        sched = replace(config, num_pages=config.num_pages - 1)
        return PrefillScheduler(sched, min(self.config.prefill_chunk, sched.token_budget - sched.max_batch - 1),
                                fold_first_decode=not self.policy.sample_at_prompt_end)

    def check(self, request: GenerationRequest) -> None:
        if request.sampling.ras_window > self.config.ras_window_max:
            raise InvalidInputError(f"ras_window {request.sampling.ras_window} exceeds this engine's maximum "
                                    f"{self.config.ras_window_max}")

    @property
    def busy(self) -> bool:
        return len(self.queue) > 0

    @property
    def in_flight(self) -> int:
        return len(self.queue)

    @property
    def wait_s(self) -> float:
        """Host time spent waiting for the device (benchmarks: host-bound or device-bound)."""
        return self.queue.wait_s

    @property
    def late_launches(self) -> int:
        """Prompt-only launches made while waiting (late_prompts)."""
        return self.queue.late_launches

    @property
    def late_prompts(self) -> bool:
        """Whether run() can take late prompts: the family samples at the prompt end (a prompt that folds
        its first decode token into its step needs that step's decode rows)."""
        return self.policy.sample_at_prompt_end

    def run(self, plan: list[Chunk], sync: bool = False, late: LateCall | None = None) -> list[RowOut]:
        """Launch this step (if anything is planned), then return the rows of what was in flight before it
        (`LaunchQueue.run`: one launch stays in flight; `sync`: none; `late`: prompts launched while the host waits,
        `late_prompts`)."""
        return self.queue.run(self._launch(plan) if plan else None, sync, late)

    def gemv_choices(self) -> dict[str, GemvChoice]:
        """engine/gemv_choice.py's choice for each FastTalker of this runner: the talker's and, for a family that
        completes rows on its own stack, that one's (Qwen3-TTS: "code_predictor")."""
        out = {"talker": self.fast.gemv}
        predictor = getattr(self.fast.complete_rows, "fast", None)  # FastCodePredictor's FastTalker
        if predictor is not None:
            out["code_predictor"] = predictor.gemv
        return out

    def release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.state.release(seq.slot)
            self._free_slots.append(seq.slot)
            seq.slot = None

    # ------------------------------------------------------------------ stages
    def _launch(self, plan: list[Chunk]) -> Launched | None:
        """Stage, run and start copying back one step; returns it (None: nothing sampled).

        Device order: the prompt chunks (packs of first chunks, other chunks one per forward; one
        sample-and-advance for the prompts that end, if the family samples there), then the decode
        rows (one graph replay, or one eager forward), which include the folded first decode token
        of the prompts that end."""
        self._wait_staged()
        decode = [c for c in plan if not c.prefill]
        prefill = [c for c in plan if c.prefill]
        self.last_prefill = len(prefill)  # benchmarks' traces
        ends = [c for c in prefill if samples_at(c, self.policy)]  # prompt ends that are sampled
        self._start_streams([c for c in prefill if c.last_of_prompt])  # slots before any sampling
        parts: list[torch.Tensor] = []
        staged = None
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
        self._staged = staged or self._record_staged()
        if not parts:
            return None
        return self.queue.ship(parts[0] if len(parts) == 1 else torch.cat(parts), [c.seq for c in ends + decode])

    def _launch_prompts(self, chunks: list[Chunk]) -> Launched | None:
        """A launch of prompt chunks alone (late prompts): their K/V, and their first rows where sampled."""
        self._wait_staged()
        self._start_streams([c for c in chunks if c.last_of_prompt])
        first = self._prefill(chunks)
        self._staged = self._record_staged()
        return None if first is None else self.queue.ship(first, [c.seq for c in chunks if samples_at(c, self.policy)])

    def _wait_staged(self) -> None:
        """The host staging buffers of the last launch are free again (its input copies ran)."""
        self.queue.wait(self._staged)

    def _kv_slot(self, table: list[int], pos: int) -> int:
        ps = self.cache.allocator.page_size
        return table[pos // ps] * ps + pos % ps

    def _graph_stage(self, decode: list[Chunk]) -> int:
        alloc = self.cache.allocator
        tables = [alloc.page_table(c.sid) for c in decode]
        return self.graphs.stage(
            positions=[c.start for c in decode],
            kv_slots=[self._kv_slot(t, c.start) for t, c in zip(tables, decode)],
            slots=[c.seq.slot for c in decode],
            page_tables=tables, kv_lens=[c.end for c in decode], text_ids=_text_ids(decode),
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
        """The graph's body (`decode_step`), eagerly, for exactly these rows: one all-audio forward +
        sampling (+ the family's row completion)."""
        alloc, n = self.cache.allocator, len(decode)
        tables = [alloc.page_table(c.sid) for c in decode]
        inputs = upload(np.array([[c.start for c in decode],
                                  [self._kv_slot(tb, c.start) for tb, c in zip(tables, decode)],
                                  [c.seq.slot for c in decode], [1] * n, _text_ids(decode)], np.int64),
                        self.device, torch.long)  # [5, D]
        self._plan_attention(tables, [c.end for c in decode], [1] * n)
        return decode_step(self.fast, self.state, self._attn, self.cache.pool.k, self.cache.pool.v, inputs,
                           torch.arange(n, device=self.device))[0]

    def _prefill(self, chunks: list[Chunk]) -> torch.Tensor | None:
        """The step's prompt chunks: first chunks `PrefillGraphs` fits (all text, or any of a family that
        embeds its own rows) replayed, up to `prefill_pack` of them per replay; the others eagerly, one
        chunk per forward. Returns packed [E, K + 1] for the chunks whose last row is sampled (prompt
        ends, if the family samples there; in plan order), else None."""
        alloc, dev, pg = self.cache.allocator, self.device, self.prefill_graphs
        got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # chunk index -> (logits [1, h, V], hidden [1, H])
        graphed: list[tuple[int, FirstChunk]] = []
        for i, c in enumerate(chunks):
            p = c.seq.prompt
            table = alloc.page_table(c.sid)
            ids, codes, audio = p.input_ids[c.start:c.end], p.audio_codes[c.start:c.end], p.is_audio[c.start:c.end]
            kv_slots = [self._kv_slot(table, q) for q in range(c.start, c.end)]
            # the prompt's other tracks in this chunk (read by a family that embeds its own rows)
            codec = None if p.codec_ids is None else p.codec_ids[c.start:c.end]
            inside = (p.vector_rows >= c.start) & (p.vector_rows < c.end)
            vec_rows, vecs = (p.vector_rows[inside] - c.start, p.vectors[inside]) if inside.any() else (None, None)
            if pg is not None and c.start == 0 and pg.fits(c.num_tokens, int(audio.sum()), int(inside.sum())):
                graphed.append((i, FirstChunk(ids, kv_slots, codes, audio, codec, vec_rows, vecs)))
                continue
            sampled = samples_at(c, self.policy)
            h = self._eager_chunk(c, table, ids, codes, audio, codec, vec_rows, vecs, kv_slots, sampled)
            if sampled:
                got[i] = (self.fast.audio_logits(h), h)  # [1, h, V]
        packs = pg.packs([fc for _, fc in graphed]) if graphed else []
        if len(packs) == 1 and not got and all(samples_at(chunks[i], self.policy) for i, _ in graphed):
            # the common case, one pack holding every sampled chunk in plan order: its outputs as they are
            # (no per-row clones and concatenation: fewer calls, each of which waits for the GIL under load)
            logits_, hidden_ = pg.run_many([fc for _, fc in graphed])
            order = [i for i, _ in graphed]
        else:
            for pack in packs:
                logits, hidden = pg.run_many([graphed[j][1] for j in pack])  # the next replay rewrites them
                for row, j in enumerate(pack):
                    i = graphed[j][0]
                    if samples_at(chunks[i], self.policy):
                        got[i] = (logits[row:row + 1].clone(), hidden[row:row + 1].clone())
            if not got:
                return None
            order = sorted(got)
            logits_, hidden_ = torch.cat([got[i][0] for i in order]), torch.cat([got[i][1] for i in order])
        slots = [chunks[i].seq.slot for i in order]
        if self.prompt_ends is not None:
            return self.prompt_ends.run(logits_, hidden_, slots)
        ones = torch.ones(len(slots), dtype=torch.bool, device=dev)
        return self.state.sample_and_advance(logits_, upload(slots, dev, torch.long), ones, hidden_)

    def _eager_chunk(self, c: Chunk, table: list[int], ids: np.ndarray, codes: np.ndarray, audio: np.ndarray,
                     codec: np.ndarray | None, vec_rows: np.ndarray | None, vecs: np.ndarray | None,
                     kv_slots: list[int], sampled: bool) -> torch.Tensor | None:
        """One prompt chunk of one sequence, eagerly: K/V, and the last row's final-normed hidden state
        [1, H] when sampled. The chunk's codec ids and input vectors (rows within the chunk) travel
        along (a family that embeds its own rows reads them)."""
        dev = self.device
        t = lambda a: upload(a, dev)
        all_audio = bool(audio.all())
        inp = FastInputs(
            text_ids=t(ids), codes=t(codes), positions=t(np.arange(c.start, c.end)),
            kv_slots=t(np.array(kv_slots, np.int64)),
            out_rows=t(np.array([c.num_tokens - 1] if sampled else [], np.int64)),
            audio_rows=None if all_audio else t(np.flatnonzero(audio)),
            text_rows=None if all_audio else t(np.flatnonzero(~audio)),
            select=None if all_audio else t(audio.astype(np.int32)),
            codec_ids=None if codec is None else t(codec),
            vector_rows=None if vec_rows is None else t(vec_rows),
            vectors=None if vecs is None else upload(vecs, dev, self.fast.dtype),
        )
        self._plan_attention([table], [c.end], [c.num_tokens])
        h = self.fast.hidden(inp, self._attn, self.cache.pool.k, self.cache.pool.v)  # [R, H]
        return h if sampled else None

    def _start_streams(self, chunks: list[Chunk]) -> None:
        """AUDIO_INIT: give each sequence a device slot (a forced start row is its writer's to know)."""
        starts = []
        for c in chunks:
            s = c.seq
            s.slot = self._free_slots.pop()
            starts.append(StreamStart(s.slot, s.params, s.max_frames, s.prompt.audio_out))
        self.state.start(starts)

