"""CUDA graphs for the all-audio decode step, one per batch-size bucket.

The captured body is the whole step after the host has chosen the streams:

    codes  = state.last_col[slots]                        # the fed-back rows, on the device
    hidden = fast_talker(codes, text_ids, positions, kv_slots)  # the layers, FlashInfer decode attention
    packed = state.sample_and_advance(head(hidden), slots, valid, hidden)
                                                          # (+ the family's row completion: Qwen3-TTS's
                                                          #  code predictor, 15 sub-steps)

A step with B streams replays the smallest bucket >= B. Rows B.. are padding: `valid` is False,
they write K/V into a scratch page and their state into scratch slots, and their output is
dropped. Before each replay the host copies the step's positions/slots/text ids into the graph's static
buffers (one copy) and re-plans FlashInfer into the bucket's fixed index buffers. A step that
does not fit (batch above the largest bucket, more pages than the buffers hold) raises
`GraphShapeError`: nothing falls back silently. `DecodeGraphs(enabled=False)` runs the same body
eagerly (for debugging) with the same padding.

`PrefillGraphs` does the same for prompts' first chunks (all-text ones; any of a family that embeds its
own rows), padded to a length bucket, one prompt or a pack of them per replay, so a stream's prefill
costs a replay instead of ~600 eager launches.
`PromptEndGraphs` replays the sampling of the rows that end prompts (a family's row completion
included: Qwen3-TTS's code predictor, ~1,000 launches eagerly), per count bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from higgs_stream.engine.errors import HiggsStreamError
from higgs_stream.engine.fast_talker import FastInputs, FastTalker
from higgs_stream.engine.gpu_sampling import DeviceStreamState
from higgs_stream.engine.graph_capture import capture_buckets
from higgs_stream.kernels._triton import pdl
from higgs_stream.kernels.flashinfer_attention import GraphDecodeAttention, HostCSR, decode_kernel

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)
# fp8 weights: 3-16 rows replay the 16-row graph. H200, session 20, bench_quant over e4m3 pages, same call: a decode
# step of 4 rows took 2.82 ms on its own graph and 2.58 on the 16-row one, 8 rows 2.86 vs 2.60 (16 rows 2.63; 2 rows
# 2.40 either way); likely the fp8 linears' Triton kernels, specialized for M divisible by 16 (not profiled). The
# rows are independent in every kernel of the step. Not for bf16 weights, whose 4-row step is the cheaper (H100: 3.21
# vs 3.52 ms at 16).
FP8_BUCKETS = tuple(b for b in DEFAULT_BUCKETS if not 2 < b < 16)


def graph_buckets_for(quantize: str) -> tuple[int, ...]:
    """The decode graphs' batch buckets for a talker quantized with `quantize` (none | int8 | fp8)."""
    return FP8_BUCKETS if quantize == "fp8" else DEFAULT_BUCKETS


class GraphShapeError(HiggsStreamError):
    """A decode step does not fit the captured graphs."""


def decode_step(fast: FastTalker, state: DeviceStreamState, attn: Any, k_pool: torch.Tensor, v_pool: torch.Tensor,
                inputs: torch.Tensor, out_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step's body, graphed or eager: inputs [5, B] long (position, KV slot, state slot,
    valid, text id per row) -> (packed [B, K + 1], the head's logits [B, h, V] fp32)."""
    pos, kv_slots, slots, valid, text_ids = inputs
    inp = FastInputs(text_ids=text_ids, codes=state.last_col[slots], positions=pos, kv_slots=kv_slots,
                     out_rows=out_rows)
    hidden = fast.hidden(inp, attn, k_pool, v_pool)  # [B, H]
    logits = fast.audio_logits(hidden)  # [B, h, V] fp32
    return state.sample_and_advance(logits, slots, valid.bool(), hidden), logits


class DecodeGraphs:
    def __init__(self, fast: FastTalker, state: DeviceStreamState, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 scratch_page: int, page_size: int, max_pages: int, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 enabled: bool = True, workspace_bytes: int = 256 << 20, tensor_core_from: int | None = None,
                 triton_from: int | None = None, ranged_below: bool = False, pdl_max_rows: int = 0) -> None:
        """`tensor_core_from`: buckets of at least this many rows over 16-bit K/V pages attend with FlashInfer's
        tensor-core decode (ModelRunnerConfig.tensor_core_decode_from); `triton_from`: buckets of at least this
        many rows with our Triton decode kernel (ModelRunnerConfig.triton_decode_from; it wins over the former);
        `ranged_below`: smaller buckets with its ranged form, for sequences of up to `fast.max_positions` tokens
        (ModelRunnerConfig.triton_ranged_decode); `pdl_max_rows`: buckets of at most this many rows are captured with
        programmatic dependent launches (ModelRunnerConfig.pdl_max_rows; the caller checks the device)."""
        self.fast, self.state, self.k_pool, self.v_pool = fast, state, k_pool, v_pool
        self.pdl_max_rows = pdl_max_rows
        self.buckets = tuple(sorted(set(buckets)))
        assert self.buckets[0] >= 1, "buckets must be positive"
        self.max_batch = self.buckets[-1]
        assert state.w and state.last_col.shape[0] >= state.num_slots + self.max_batch, \
            "the state needs one scratch slot per padded row"
        self.scratch_page, self.page_size, self.max_pages = scratch_page, page_size, max_pages
        self.enabled = enabled
        dev = fast.device
        self._inputs = torch.zeros((5, self.max_batch), dtype=torch.long, device=dev)  # pos, kv slot, slot, valid, text
        self._staging = torch.zeros((5, self.max_batch), dtype=torch.long).pin_memory()
        self._out_rows = torch.arange(self.max_batch, device=dev)
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=dev)
        self.kernels = {b: decode_kernel(b, k_pool.element_size(), tensor_core_from, triton_from, ranged_below)
                        for b in self.buckets}
        self._attn = {b: GraphDecodeAttention(b, max_pages + b, *fast.heads, page_size, dev, self._workspace, fast.dtype,
                                              kv_dtype=k_pool.dtype, kernel=self.kernels[b],
                                              max_kv_len=fast.max_positions if self.kernels[b] == "triton_ranges"
                                              else None) for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (packed, logits)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ capture
    def _body(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_step(self.fast, self.state, self._attn[b], self.k_pool, self.v_pool, self._inputs[:, :b],
                           self._out_rows[:b])  # [b, K + 1], [b, h, V]

    def _stage(self, b: int, positions: Sequence[int], kv_slots: Sequence[int], slots: Sequence[int],
               page_tables: list[list[int]], kv_lens: list[int], text_ids: Sequence[int] = ()) -> None:
        """Fill the static inputs (one H2D copy) and plan attention for bucket b."""
        n, ps = len(slots), self.page_size
        pad = b - n
        st = self._staging.numpy()
        st[0, :n], st[1, :n], st[2, :n], st[3, :n] = positions, kv_slots, slots, 1
        st[4, :n] = text_ids if len(text_ids) else 0
        st[0, n:b] = 0
        st[1, n:b] = self.scratch_page * ps + np.arange(pad) % ps
        st[2, n:b] = self.state.num_slots + np.arange(pad)
        st[3, n:b] = 0
        st[4, n:b] = 0
        self._inputs[:, :b].copy_(self._staging[:, :b], non_blocking=True)
        csr = HostCSR.build(page_tables + [[self.scratch_page]] * pad, kv_lens + [1] * pad, [1] * b, ps)
        if csr.kv_indices.shape[0] > self.max_pages + b:
            raise GraphShapeError(f"decode step needs {csr.kv_indices.shape[0]} pages, the graph buffers hold {self.max_pages + b}")
        self._attn[b].plan(csr)

    def capture(self) -> None:
        """Capture every bucket (largest first, sharing one memory pool)."""
        if not self.enabled:
            return
        def body(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            with pdl(b <= self.pdl_max_rows):  # warm-up and capture: the Triton launches read the switch
                return self._body(b)

        self._graphs, self._outputs = capture_buckets(self.buckets, lambda b: self._stage(b, [], [], [], [], []), body)

    # ------------------------------------------------------------------ replay
    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise GraphShapeError(f"decode batch {n} exceeds the largest captured bucket {self.max_batch}")

    def run(self, positions: Sequence[int], kv_slots: Sequence[int], slots: Sequence[int],
            page_tables: list[list[int]], kv_lens: list[int], text_ids: Sequence[int] = ()) -> torch.Tensor:
        """One decode step for len(slots) streams -> packed [B, K + 1] long on the device."""
        return self.replay(self.stage(positions, kv_slots, slots, page_tables, kv_lens, text_ids), len(slots))

    def stage(self, positions: Sequence[int], kv_slots: Sequence[int], slots: Sequence[int],
              page_tables: list[list[int]], kv_lens: list[int], text_ids: Sequence[int] = ()) -> int:
        """Fill the static inputs and plan attention for len(slots) streams; returns the bucket.
        `text_ids`: each row's text-track id (family.Prompt.step_text_id; () = 0, for families whose
        decode rows ignore it). The host buffers it used may be refilled once the device has run what
        it queued."""
        n = len(slots)
        assert n >= 1 and len(positions) == len(kv_slots) == n == len(page_tables) == len(kv_lens), "one entry per stream"
        assert len(text_ids) in (0, n), "one text id per stream"
        b = self.bucket_for(n)
        self._stage(b, positions, kv_slots, slots, page_tables, kv_lens, text_ids)
        return b

    def replay(self, b: int, n: int) -> torch.Tensor:
        """Run the staged step in bucket b -> packed [n, K + 1]."""
        if not self.enabled:
            self._last = self._body(b)
        elif b not in self._graphs:
            raise GraphShapeError(f"bucket {b} was not captured (call capture() first)")
        else:
            self._graphs[b].replay()
            self._last = self._outputs[b]
        return self._last[0][:n]

    def last_logits(self, n: int) -> torch.Tensor:
        """The head's logits [n, h, V] fp32 of the last run (valid until the next run)."""
        assert self._last is not None, "no step has run"
        return self._last[1][:n]


PREFILL_BUCKETS = (32, 64, 128, 256, 512)
PROMPT_END_BUCKETS = (1, 2, 4, 8)


class PromptEndGraphs:
    """The sampling of the rows that end prompts in one step: `state.sample_and_advance` on their
    audio logits (and, for a family that completes rows, their hidden states), replayed from a CUDA
    graph per count bucket. Without it a Qwen3-TTS stream's first frame ran its code predictor's 15
    sub-steps eagerly: ~2,300 launches, 60-100 ms of host time on an H100 (scripts/profile_first_step.py).

    Rows are padded to the smallest bucket >= their count: padded rows are invalid and use scratch
    slots (as in DecodeGraphs), their outputs are dropped; more rows than the largest bucket run in
    several replays. `enabled=False` runs the same padded body eagerly.
    """

    def __init__(self, state: DeviceStreamState, hidden_size: int, logits_shape: tuple[int, int],
                 hidden_dtype: torch.dtype, buckets: Sequence[int] = PROMPT_END_BUCKETS, enabled: bool = True) -> None:
        self.state, self.enabled = state, enabled
        self.buckets = tuple(sorted(set(buckets)))
        top = self.buckets[-1]
        assert self.buckets[0] >= 1 and state.last_col.shape[0] >= state.num_slots + top, \
            "the state needs one scratch slot per padded row"
        dev = state.device
        self._logits = torch.zeros((top, *logits_shape), dtype=torch.float32, device=dev)
        self._hidden = torch.zeros((top, hidden_size), dtype=hidden_dtype, device=dev)
        self._index = torch.zeros((2, top), dtype=torch.long, device=dev)  # slot, valid
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def _body(self, b: int) -> torch.Tensor:
        hidden = self._hidden[:b] if self.state.complete is not None else None
        return self.state.sample_and_advance(self._logits[:b], self._index[0, :b], self._index[1, :b].bool(), hidden)

    def _stage(self, b: int, logits: torch.Tensor | None, hidden: torch.Tensor | None, slots: Sequence[int]) -> None:
        n = len(slots)
        index = np.zeros((2, b), np.int64)
        index[0, :n], index[1, :n] = slots, 1
        index[0, n:] = self.state.num_slots + np.arange(b - n)
        self._index[:, :b].copy_(torch.from_numpy(index), non_blocking=True)  # one call: under load each waits for the GIL
        if logits is not None:
            self._logits[:n].copy_(logits)
        if hidden is not None:
            self._hidden[:n].copy_(hidden)

    def capture(self) -> None:
        """Capture every bucket (largest first, one memory pool)."""
        if self.enabled:
            self._graphs, self._outputs = capture_buckets(self.buckets, lambda b: self._stage(b, None, None, []),
                                                          self._body, self.state.device)

    def run(self, logits: torch.Tensor, hidden: torch.Tensor | None, slots: Sequence[int]) -> torch.Tensor:
        """logits [E, h, V] fp32, hidden [E, H] (None: a family that does not complete rows), the E
        streams' slots -> packed [E, K + 1] long (sample_and_advance's)."""
        assert logits.shape[0] == len(slots) >= 1 and (hidden is None or hidden.shape[0] == len(slots))
        assert hidden is not None or self.state.complete is None, "completing rows needs their hidden states"
        top, parts = self.buckets[-1], []
        for i in range(0, len(slots), top):
            n = min(top, len(slots) - i)
            b = next(b for b in self.buckets if b >= n)
            self._stage(b, logits[i:i + n], None if hidden is None else hidden[i:i + n], slots[i:i + n])
            out = self._body(b) if not self.enabled else (self._graphs[b].replay() or self._outputs[b])
            parts.append(out[:n] if len(slots) <= top else out[:n].clone())  # the next replay rewrites out
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class ChunkAttention:
    """Causal attention of prompts' first chunks over themselves, from the pool rows they just wrote:
    gathers K/V at the chunks' slots and runs SDPA. Fixed shapes (padded to a bucket; padded rows
    come last). `seg` [L] (static): the prompt each row belongs to when several are packed; a row
    then sees the earlier rows of its own prompt only. None: one prompt (plain causal attention)."""

    def __init__(self, kv_slots: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 seg: torch.Tensor | None = None) -> None:
        self.kv_slots = kv_slots  # [L] long, static
        self.hq, self.hkv, self.d = num_q_heads, num_kv_heads, head_dim
        self.seg = seg

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [L, Hq, D], pools [P, page, Hkv, D] -> [L, Hq, D]."""
        group = self.hq // self.hkv
        k = k_cache.view(-1, self.hkv, self.d)[self.kv_slots].to(q.dtype)  # [L, Hkv, D] (an fp8 pool: widened)
        v = v_cache.view(-1, self.hkv, self.d)[self.kv_slots].to(q.dtype)
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1)[None] for t in (k, v))  # [1, Hq, L, D]
        qh = q.transpose(0, 1)[None]
        if self.seg is None:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=self.d**-0.5)  # [1, Hq, L, D]
        else:
            row = torch.arange(q.shape[0], device=q.device)
            keep = (self.seg[:, None] == self.seg[None, :]) & (row[:, None] >= row[None, :])  # block-diagonal causal
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=keep[None, None], scale=self.d**-0.5)
        return o[0].transpose(0, 1).contiguous()


@dataclass(frozen=True)
class FirstChunk:
    """Rows 0..n-1 of one prompt for `PrefillGraphs`: text ids and K/V slots, and for a family that
    embeds its own rows the chunk's frames (`codes` [n, K] at the `audio` rows), codec ids and input
    vectors (`vector_rows` within the chunk)."""

    text_ids: np.ndarray
    kv_slots: Sequence[int]
    codes: np.ndarray | None = None
    audio: np.ndarray | None = None
    codec_ids: np.ndarray | None = None
    vector_rows: np.ndarray | None = None
    vectors: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.text_ids)

    @property
    def num_vectors(self) -> int:
        return 0 if self.vector_rows is None else len(self.vector_rows)


class PrefillGraphs:
    """Prompts' first chunks, replayed from a CUDA graph per length bucket: all-text chunks (v2 without a
    reference or history, v3), or any first chunk of a family that embeds its own rows (Qwen3-TTS:
    text track, codec ids, reference frames and input vectors, all staged into the graph's buffers).

    `max_prompts` 1: one prompt per replay, plain causal attention; nothing but the prompt decides its
    K/V and logits (batch-invariant prefill). Above 1: up to that many first chunks packed into one
    replay (`run_many`; their rows one after another, positions restarting at 0 for each, attention
    block-diagonal causal), so a burst of arrivals reads the weights once per pack instead of once per
    prompt; a prompt's numbers then depend on its pack (GEMM shapes) to fp rounding.

    The rows are padded to the smallest bucket >= their count: padded rows are text id 0 at position 0
    (no codec id, no frame; after every real row, so no real row sees them), their K/V go to the scratch page, their outputs are dropped; unused vector entries add
    zeros to row 0. The body is `FastTalker.hidden` (every row on the text branch of a dual-FFN family)
    with `ChunkAttention`; it returns the audio logits and final-normed hidden state of each prompt's
    last row (v3 and Qwen3-TTS sample there, Qwen3-TTS completes the row from the hidden state; v2
    ignores both). `enabled=False` runs the same padded body eagerly, so an engine without graphs
    computes the same numbers.
    """

    MAX_VECTORS = 16  # input vectors per replay (Qwen3-TTS: a speaker embedding per prompt)

    def __init__(self, fast: FastTalker, k_pool: torch.Tensor, v_pool: torch.Tensor, scratch_page: int,
                 page_size: int, buckets: Sequence[int] = PREFILL_BUCKETS, enabled: bool = True,
                 max_prompts: int = 1) -> None:
        self.fast, self.k_pool, self.v_pool = fast, k_pool, v_pool
        self.buckets = tuple(sorted(set(b for b in buckets if b <= fast.max_positions)))
        assert self.buckets, "no prefill bucket fits the position table"
        assert 1 <= max_prompts <= self.buckets[0], f"max_prompts {max_prompts} must be in 1..{self.buckets[0]}"
        self.scratch_page, self.page_size, self.enabled = scratch_page, page_size, enabled
        self.max_prompts = max_prompts
        self.embeds = fast.embed_rows is not None  # the family stages its other tracks too
        dev, top, k = fast.device, self.buckets[-1], fast.cfg.num_codebooks
        # ids, kv slot, out rows, codec, select, position, prompt index, codes
        self._rows = torch.zeros((7 + k, top), dtype=torch.long, device=dev)
        self._ids, self._slots, self._codec = self._rows[0], self._rows[1], self._rows[3]
        self._out = self._rows[2, :max_prompts]
        self._pos, self._seg = self._rows[5], self._rows[6]
        self._select = torch.zeros(top, dtype=torch.int32, device=dev)
        self._codes = self._rows[7:].t()  # [top, K], a view: staged with the rest in one copy
        self._arange = torch.arange(top, device=dev)
        self._vector_rows = torch.zeros(self.MAX_VECTORS, dtype=torch.long, device=dev)
        self._vectors = torch.zeros((self.MAX_VECTORS, fast.cfg.hidden_size), dtype=fast.dtype, device=dev)
        self._no_rows = torch.zeros(0, dtype=torch.long, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def max_len(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise GraphShapeError(f"prompt chunk of {n} tokens exceeds the largest prefill bucket {self.max_len}")

    def fits(self, n: int, audio_rows: int, vectors: int) -> bool:
        """Whether a first chunk of n rows (audio_rows of them frames, `vectors` input vectors) replays here."""
        return n <= self.max_len and (audio_rows == 0 or self.embeds) and (vectors == 0 or self.embeds) \
            and vectors <= self.MAX_VECTORS

    def packs(self, chunks: Sequence[FirstChunk]) -> list[list[int]]:
        """The chunks (each `fits`) cut into replays, in order: a pack grows while its rows fit the
        largest bucket, its prompts `max_prompts` and its vectors MAX_VECTORS."""
        out: list[list[int]] = []
        rows = vecs = 0
        for i, c in enumerate(chunks):
            if not out or len(out[-1]) == self.max_prompts or rows + c.num_rows > self.max_len \
                    or vecs + c.num_vectors > self.MAX_VECTORS:
                out.append([])
                rows = vecs = 0
            out[-1].append(i)
            rows, vecs = rows + c.num_rows, vecs + c.num_vectors
        return out

    def _body(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        hq, hkv, d = self.fast.heads
        tracks = ({"codec_ids": self._codec[:b], "vector_rows": self._vector_rows, "vectors": self._vectors}
                  if self.embeds else {})
        inp = FastInputs(text_ids=self._ids[:b], codes=self._codes[:b], positions=self._pos[:b],
                         kv_slots=self._slots[:b], out_rows=self._out, audio_rows=self._no_rows,
                         text_rows=self._arange[:b], select=self._select[:b], **tracks)
        attn = ChunkAttention(self._slots[:b], hq, hkv, d, self._seg[:b] if self.max_prompts > 1 else None)
        hidden = self.fast.hidden(inp, attn, self.k_pool, self.v_pool)
        return self.fast.audio_logits(hidden), hidden  # [P, h, V] fp32, [P, H]

    def capture(self) -> None:
        """Capture every bucket (largest first, one memory pool)."""
        if not self.enabled:
            return
        dummy = FirstChunk(np.zeros(1, np.int64), [self.scratch_page * self.page_size])
        self._graphs, self._outputs = capture_buckets(self.buckets, lambda b: self._stage(b, [dummy]), self._body)

    def _stage(self, b: int, chunks: Sequence[FirstChunk]) -> None:
        """Fill the static inputs: one copy from fresh pageable memory (several packs may be staged in
        one step, so no staging buffer is reused while a copy may be pending)."""
        ps, p = self.page_size, len(chunks)
        st = np.zeros((self._rows.shape[0], b), np.int64)
        st[3] = -1  # no codec id
        st[6] = self.max_prompts  # padded rows: a prompt of their own
        rows, vecs = np.zeros(self.MAX_VECTORS, np.int64), np.zeros(tuple(self._vectors.shape), np.float32)
        r = m = 0
        for j, c in enumerate(chunks):
            n = c.num_rows
            st[0, r:r + n], st[1, r:r + n] = c.text_ids, c.kv_slots
            st[5, r:r + n], st[6, r:r + n] = np.arange(n), j
            if self.embeds:  # the family's other tracks (others: all-text chunks, every row on the text branch)
                if c.codec_ids is not None:
                    st[3, r:r + n] = c.codec_ids
                if c.audio is not None:
                    st[4, r:r + n] = c.audio
                if c.codes is not None:
                    st[7:, r:r + n] = np.asarray(c.codes).T
                if c.num_vectors:
                    rows[m:m + c.num_vectors], vecs[m:m + c.num_vectors] = np.asarray(c.vector_rows) + r, c.vectors
                    m += c.num_vectors
            r += n
            st[2, j] = r - 1  # the prompt's last row
        st[2, p:self.max_prompts] = r - 1  # unused outputs repeat the last prompt's (dropped)
        st[1, r:b] = self.scratch_page * ps + np.arange(b - r) % ps
        self._rows[:, :b].copy_(torch.from_numpy(st), non_blocking=True)
        self._select[:b].copy_(self._rows[4, :b])
        if self.embeds:
            self._vector_rows.copy_(torch.from_numpy(rows), non_blocking=True)
            self._vectors.copy_(torch.from_numpy(vecs), non_blocking=True)

    def run_many(self, chunks: Sequence[FirstChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill every chunk (one pack: see `packs`) in one replay -> (audio logits [p, h, V], hidden
        [p, H]) of each chunk's last row, in order (views of the graph's buffers: valid until the next run)."""
        p = len(chunks)
        n = sum(c.num_rows for c in chunks)
        assert 1 <= p <= self.max_prompts and sum(c.num_vectors for c in chunks) <= self.MAX_VECTORS, "not one pack"
        assert all(c.num_rows >= 1 and len(c.kv_slots) == c.num_rows for c in chunks), "one slot per token"
        b = self.bucket_for(n)
        self._stage(b, chunks)
        logits, hidden = self._body(b) if not self.enabled else (self._graphs[b].replay() or self._outputs[b])
        return logits[:p], hidden[:p]
