"""CUDA graphs for the all-audio decode step, one per batch-size bucket.

The captured body is the whole step after the host has chosen the streams:

    codes  = state.last_col[slots]                        # the fed-back columns, on the device
    logits = fast_talker(codes, positions, kv_slots)      # 28 layers, FlashInfer decode attention
    packed = state.sample_and_advance(logits, slots, valid)

A step with B streams replays the smallest bucket >= B. Rows B.. are padding: `valid` is False,
they write K/V into a scratch page and their state into scratch slots, and their output is
dropped. Before each replay the host copies the step's positions/slots into the graph's static
buffers (one copy) and re-plans FlashInfer into the bucket's fixed index buffers. A step that
does not fit (batch above the largest bucket, more pages than the buffers hold) raises
`GraphShapeError`: nothing falls back silently. `DecodeGraphs(enabled=False)` runs the same body
eagerly (for debugging) with the same padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from higgs_stream.engine.errors import HiggsStreamError
from higgs_stream.engine.fast_talker import FastInputs, FastTalker
from higgs_stream.engine.gpu_sampling import DeviceStreamState
from higgs_stream.kernels.flashinfer_attention import GraphDecodeAttention, HostCSR

DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256)


class GraphShapeError(HiggsStreamError):
    """A decode step does not fit the captured graphs."""


class DecodeGraphs:
    def __init__(self, fast: FastTalker, state: DeviceStreamState, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 scratch_page: int, page_size: int, max_pages: int, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 enabled: bool = True, workspace_bytes: int = 256 << 20) -> None:
        self.fast, self.state, self.k_pool, self.v_pool = fast, state, k_pool, v_pool
        self.buckets = tuple(sorted(set(buckets)))
        assert self.buckets[0] >= 1, "buckets must be positive"
        self.max_batch = self.buckets[-1]
        assert state.w and state.last_col.shape[0] >= state.num_slots + self.max_batch, \
            "the state needs one scratch slot per padded row"
        self.scratch_page, self.page_size, self.max_pages = scratch_page, page_size, max_pages
        self.enabled = enabled
        dev = fast.device
        self._inputs = torch.zeros((4, self.max_batch), dtype=torch.long, device=dev)  # pos, kv slot, slot, valid
        self._staging = torch.zeros((4, self.max_batch), dtype=torch.long).pin_memory()
        self._out_rows = torch.arange(self.max_batch, device=dev)
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=dev)
        self._attn = {b: GraphDecodeAttention(b, max_pages + b, *fast.heads, page_size, dev, self._workspace, fast.dtype)
                      for b in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (packed, logits)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pool = None

    # ------------------------------------------------------------------ capture
    def _body(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos, kv_slots, slots, valid = self._inputs[:, :b]
        inp = FastInputs(text_ids=None, codes=self.state.last_col[slots], positions=pos, kv_slots=kv_slots,
                         out_rows=self._out_rows[:b])
        logits = self.fast.forward(inp, self._attn[b], self.k_pool, self.v_pool)  # [b, K, V] fp32
        return self.state.sample_and_advance(logits, slots, valid.bool()), logits  # [b, K + 1], [b, K, V]

    def _stage(self, b: int, positions: Sequence[int], kv_slots: Sequence[int], slots: Sequence[int],
               page_tables: list[list[int]], kv_lens: list[int]) -> None:
        """Fill the static inputs (one H2D copy) and plan attention for bucket b."""
        n, ps = len(slots), self.page_size
        pad = b - n
        st = self._staging.numpy()
        st[0, :n], st[1, :n], st[2, :n], st[3, :n] = positions, kv_slots, slots, 1
        st[0, n:b] = 0
        st[1, n:b] = self.scratch_page * ps + np.arange(pad) % ps
        st[2, n:b] = self.state.num_slots + np.arange(pad)
        st[3, n:b] = 0
        self._inputs[:, :b].copy_(self._staging[:, :b], non_blocking=True)
        csr = HostCSR.build(page_tables + [[self.scratch_page]] * pad, kv_lens + [1] * pad, [1] * b, ps)
        if csr.kv_indices.shape[0] > self.max_pages + b:
            raise GraphShapeError(f"decode step needs {csr.kv_indices.shape[0]} pages, the graph buffers hold {self.max_pages + b}")
        self._attn[b].plan(csr)

    def capture(self) -> None:
        """Capture every bucket (largest first, sharing one memory pool)."""
        if not self.enabled:
            return
        self._pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):
            self._stage(b, [], [], [], [], [])
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._body(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._outputs[b] = self._body(b)
            self._graphs[b] = graph
        torch.cuda.synchronize()

    # ------------------------------------------------------------------ replay
    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise GraphShapeError(f"decode batch {n} exceeds the largest captured bucket {self.max_batch}")

    def run(self, positions: Sequence[int], kv_slots: Sequence[int], slots: Sequence[int],
            page_tables: list[list[int]], kv_lens: list[int]) -> torch.Tensor:
        """One decode step for len(slots) streams -> packed [B, K + 1] long on the device."""
        n = len(slots)
        assert n >= 1 and len(positions) == len(kv_slots) == n == len(page_tables) == len(kv_lens), "one entry per stream"
        b = self.bucket_for(n)
        self._stage(b, positions, kv_slots, slots, page_tables, kv_lens)
        if not self.enabled:
            self._last = self._body(b)
        elif b not in self._graphs:
            raise GraphShapeError(f"bucket {b} was not captured (call capture() first)")
        else:
            self._graphs[b].replay()
            self._last = self._outputs[b]
        return self._last[0][:n]

    def last_logits(self, n: int) -> torch.Tensor:
        """The audio logits [n, K, V] fp32 of the last run (valid until the next run)."""
        assert self._last is not None, "no step has run"
        return self._last[1][:n]
