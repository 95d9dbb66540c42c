"""Paged attention through FlashInfer, planned from the same CSR layout as `attention.PagedLayout`.

One step's attention is planned once (host work, outside any CUDA graph) and run for every layer:

    attn = FlashInferAttention(num_q_heads, num_kv_heads, head_dim, page_size, device)
    attn.plan(HostCSR.from_layout(layout), decode=True)   # decode: every qo_len is 1
    out = attn.run(q, k_cache_layer, v_cache_layer)        # q [N, Hq, D] -> [N, Hq, D]

Decode steps use FlashInfer's batch decode kernel, prefill/mixed steps its paged prefill kernel with
a bottom-right aligned causal mask (query j of a sequence sees keys 0 .. kv_len - qo_len + j, as
`paged_attention_ref`). `GraphDecodeAttention` is the decode variant for one CUDA-graph batch size:
its index buffers live at fixed addresses and `plan()` refills them before each replay.

FlashInfer is imported on first use; without it (or without CUDA) a `KernelUnavailableError` says
so. There is no silent fallback: the plain-torch path is `RefAttention`, chosen explicitly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch

from higgs_stream.kernels._triton import KernelUnavailableError, require_cuda
from higgs_stream.kernels.attention import PagedLayout, paged_attention_ref
from higgs_stream.kernels.paged_decode import paged_decode

WORKSPACE_BYTES = 256 << 20


@functools.cache
def flashinfer_module() -> Any:
    try:
        import flashinfer
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise KernelUnavailableError(
            f"the GPU attention path needs FlashInfer (pip install flashinfer-python==0.5.3): {exc}"
        ) from exc
    return flashinfer


FLASHINFER_HEAD_DIMS = (64, 128, 256)  # what the bundled FlashInfer kernels are built for


def check_head_dim(head_dim: int) -> None:
    """Refuse loudly (not mid-step) a head size FlashInfer has no kernel for, e.g. the tiny test presets."""
    if head_dim not in FLASHINFER_HEAD_DIMS:
        raise KernelUnavailableError(f"FlashInfer attention supports head_dim {FLASHINFER_HEAD_DIMS}, this model has "
                                     f"{head_dim}: run the reference kernels instead (--kernels ref)")


@dataclass(frozen=True)
class HostCSR:
    """FlashInfer's CSR page layout as host int32 tensors (planning reads them on the CPU)."""

    qo_indptr: torch.Tensor  # [B+1]
    kv_indptr: torch.Tensor  # [B+1]
    kv_indices: torch.Tensor  # [sum pages]
    kv_last_page_len: torch.Tensor  # [B]

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @classmethod
    def build(cls, page_tables: list[list[int]], kv_lens: list[int], qo_lens: list[int], page_size: int) -> HostCSR:
        """From per-sequence page tables (at least ceil(kv_len / page_size) pages each) and lengths.
        Built on every decode step (hundreds of sequences at load): whole-array numpy, and the page
        indices gathered by one C-level chain over the tables' slices."""
        b = len(kv_lens)
        kv_len = np.asarray(kv_lens, np.int64)
        qo_len = np.asarray(qo_lens, np.int64)
        num_pages = (kv_len + page_size - 1) // page_size
        assert (np.fromiter(map(len, page_tables), np.int64, b) >= num_pages).all(), "a page table is too short"
        assert ((qo_len >= 1) & (qo_len <= kv_len)).all(), "need 1 <= qo_len <= kv_len"
        qo = np.zeros(b + 1, np.int32)
        np.cumsum(qo_len, out=qo[1:])
        kv = np.zeros(b + 1, np.int32)
        np.cumsum(num_pages, out=kv[1:])
        idx = np.fromiter(chain.from_iterable([t[:n] for t, n in zip(page_tables, num_pages.tolist())]), np.int32,
                          int(kv[-1]))
        last = (kv_len - (num_pages - 1) * page_size).astype(np.int32)
        return cls(torch.from_numpy(qo), torch.from_numpy(kv), torch.from_numpy(idx), torch.from_numpy(last))

    @classmethod
    def from_layout(cls, layout: PagedLayout) -> HostCSR:
        return cls.build(layout.page_tables, layout.kv_lens, layout.qo_lens, layout.page_size)


class RefAttention:
    """The plain-torch attention behind the same plan/run interface (any device; not graphable)."""

    def __init__(self, head_dim: int) -> None:
        self.sm_scale = head_dim**-0.5
        self.layout: PagedLayout | None = None

    def plan_layout(self, layout: PagedLayout) -> None:
        self.layout = layout

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        assert self.layout is not None, "plan_layout() before run()"
        return paged_attention_ref(q, k_cache, v_cache, self.layout, self.sm_scale)


def decode_kernel(rows: int, kv_bytes: int, tensor_core_from: int | None, triton_from: int | None,
                  ranged_below: bool = False) -> str:
    """The decode attention kernel of a step of `rows` rows over K/V pages of `kv_bytes` per element, replayed
    (engine/cuda_graph.py's buckets) or eager (`FlashInferAttention`'s decode plans), so both run the same one:
    our Triton kernel whole from `triton_from` rows, its ranged form below (`ranged_below`), else FlashInfer's
    tensor-core decode from `tensor_core_from` rows over 16-bit pages, else its CUDA-core decode."""
    if triton_from is not None and rows >= triton_from:
        return "triton"
    if triton_from is not None and ranged_below:
        return "triton_ranges"
    if tensor_core_from is not None and rows >= tensor_core_from and kv_bytes == 2:
        return "tensor_cores"
    return "cuda_cores"


class FlashInferAttention:
    """Eager FlashInfer attention for one step at a time (any batch size, decode or prefill)."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 workspace: torch.Tensor | None = None, kv_dtype: torch.dtype | None = None,
                 triton_from: int | None = None, ranged_max_kv_len: int | None = None) -> None:
        """`dtype`: the queries'; `kv_dtype`: the pools' (None: the same; fp8 e4m3 pools, unscaled).
        Decode steps attend with the kernel the decode graphs would (`decode_kernel`; FlashInfer's tensor-core
        decode aside): our Triton kernel whole from `triton_from` rows, its ranged form below for sequences of at
        most `ranged_max_kv_len` tokens (None: FlashInfer's CUDA-core decode below)."""
        self.triton_from, self.ranged_max_kv_len = triton_from, ranged_max_kv_len
        self._csr_host: torch.Tensor | None = None
        fi = flashinfer_module()
        if torch.device(device).type != "cuda":
            raise KernelUnavailableError(f"FlashInfer attention needs a CUDA device, got {device}")
        check_head_dim(head_dim)
        self.heads = (num_q_heads, num_kv_heads, head_dim)
        self.page_size, self.dtype, self.kv_dtype = page_size, dtype, kv_dtype or dtype
        self.workspace = workspace if workspace is not None else torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        self._active: Any = None

    def plan(self, csr: HostCSR, decode: bool) -> None:
        hq, hkv, d = self.heads
        if not decode:
            self._prefill.plan(csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, hq, hkv, d,
                               self.page_size, causal=True, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                               sm_scale=d**-0.5)
            self._active = self._prefill
        else:
            assert csr.num_tokens == csr.batch_size, "a decode plan needs qo_len 1 for every sequence"
            b = csr.batch_size
            kernel = decode_kernel(b, 0, None, self.triton_from, self.ranged_max_kv_len is not None)
            if kernel.startswith("triton"):  # one upload of the CSR; the kernel reads it on the device
                self._csr_host = torch.cat((csr.kv_indptr, csr.kv_last_page_len, csr.kv_indices)).pin_memory()
                dev = self._csr_host.to(self.workspace.device, non_blocking=True)
                self._csr_dev = (dev[: b + 1], dev[2 * b + 1:], dev[b + 1: 2 * b + 1])  # indptr, indices, last
                self._triton_max_kv_len = self.ranged_max_kv_len if kernel == "triton_ranges" else None
                self._active = "triton"
            else:
                self._decode.plan(csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len, hq, hkv, d, self.page_size,
                                  q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=d**-0.5)
                self._active = self._decode
        self._num_tokens = csr.num_tokens

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], pools [P, page, Hkv, D] -> [N, Hq, D]."""
        assert self._active is not None, "plan() before run()"
        assert q.shape[0] == self._num_tokens, f"q has {q.shape[0]} rows, the plan {self._num_tokens}"
        require_cuda(q, k_cache, v_cache, what="FlashInfer attention")
        if self._active == "triton":
            return paged_decode(q, k_cache, v_cache, *self._csr_dev, self.heads[2] ** -0.5,
                                max_kv_len=self._triton_max_kv_len)
        return self._active.run(q, (k_cache, v_cache))


DECODE_KERNELS = ("cuda_cores", "tensor_cores", "triton", "triton_ranges")


class GraphDecodeAttention:
    """Decode attention for one fixed (padded) batch size, capturable in a CUDA graph.

    Index buffers are allocated once for `max_pages` page indices; `plan()` (host, before each
    replay) copies the step's CSR into them and, for FlashInfer's kernels, refreshes their split schedule.
    `kernel`: FlashInfer's CUDA-core decode ("cuda_cores"), its tensor-core decode (its prefill kernel
    with every qo_len 1, "tensor_cores"), or our Triton kernel (`kernels.paged_decode`, "triton": whole,
    "triton_ranges": its batch-invariant ranged form over sequences of at most `max_kv_len` tokens; no host planning,
    one upload of the whole CSR; `triton_params`: keyword arguments of `paged_decode`, e.g. its block_n / num_warps /
    num_stages, for benchmarks; default its own).
    """

    def __init__(self, batch_size: int, max_pages: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, device: torch.device, workspace: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None,
                 kernel: str = "cuda_cores", triton_params: dict | None = None, max_kv_len: int | None = None) -> None:
        if kernel not in DECODE_KERNELS:
            raise ValueError(f"decode kernel must be one of {DECODE_KERNELS}, got {kernel!r}")
        if (kernel == "triton_ranges") != (max_kv_len is not None):
            raise ValueError("max_kv_len goes with the 'triton_ranges' kernel, and only with it")
        self.max_kv_len = max_kv_len
        self.batch_size, self.max_pages, self.kernel = batch_size, max_pages, kernel
        self.triton_params = dict(triton_params or {})
        check_head_dim(head_dim)
        self.heads = (num_q_heads, num_kv_heads, head_dim)
        self.page_size, self.dtype, self.kv_dtype = page_size, dtype, kv_dtype or dtype
        # one buffer: indptr [B+1] | last page lengths [B] | page indices [max_pages] (the Triton kernel's CSR
        # arrives in one copy); FlashInfer's wrapper gets the three views
        self._csr = torch.zeros(2 * batch_size + 1 + max_pages, dtype=torch.int32, device=device)
        self._indptr = self._csr[: batch_size + 1]
        self._last = self._csr[batch_size + 1: 2 * batch_size + 1]
        self._indices = self._csr[2 * batch_size + 1:]
        self._last.fill_(1)
        self._wrapper = None
        if not kernel.startswith("triton"):
            self._indices_in = torch.zeros(max_pages, dtype=torch.int32, device=device)  # the step's indices
            self._wrapper = flashinfer_module().BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=kernel == "tensor_cores",
                paged_kv_indptr_buffer=self._indptr, paged_kv_indices_buffer=self._indices,
                paged_kv_last_page_len_buffer=self._last)

    def plan(self, csr: HostCSR) -> None:
        if csr.batch_size != self.batch_size:
            raise ValueError(f"graph decode attention is fixed at batch {self.batch_size}, got {csr.batch_size}")
        if csr.kv_indices.shape[0] > self.max_pages:
            raise ValueError(f"{csr.kv_indices.shape[0]} pages exceed the graph buffer of {self.max_pages}")
        n = csr.kv_indices.shape[0]
        if self._wrapper is None:  # the Triton kernel reads the CSR from the device: one async upload, no plan
            host = torch.cat((csr.kv_indptr, csr.kv_last_page_len, csr.kv_indices)).pin_memory()
            self._csr[: host.shape[0]].copy_(host, non_blocking=True)
            return
        hq, hkv, d = self.heads
        # FlashInfer copies host indices synchronously (the host would wait for the previous replay); upload
        # them asynchronously from pinned memory and hand it a device tensor (a device-to-device copy in order)
        indices = self._indices_in[:n]
        indices.copy_(csr.kv_indices.pin_memory(), non_blocking=True)
        self._wrapper.plan(csr.kv_indptr, indices, csr.kv_last_page_len, hq, hkv, d, self.page_size,
                           q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=d**-0.5)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        assert q.shape[0] == self.batch_size, f"q has {q.shape[0]} rows, the graph batch is {self.batch_size}"
        if self._wrapper is None:
            return paged_decode(q, k_cache, v_cache, self._indptr, self._indices, self._last, self.heads[2] ** -0.5,
                                max_kv_len=self.max_kv_len, **self.triton_params)
        return self._wrapper.run(q, (k_cache, v_cache))
