"""Paged KV cache: a plain-Python page allocator and the per-layer K/V page pool it indexes.

`PageAllocator` is bookkeeping only (no torch): each sequence owns a list of pages holding its
`seq_len` tokens. `KVPool` owns the tensors `k`, `v` of shape [L, P, page_size, Hkv, D]. The talker
gets a `KVCache` (both together); the engine reserves room for a step's new tokens before the
forward, and frees a sequence's pages when its stream ends.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from higgs_stream.engine.errors import CapacityError, ConfigError, NotFoundError
from higgs_stream.engine.talker_config import BackboneConfig
from higgs_stream.kernels.attention import PagedLayout


class PageAllocator:
    """Hands out fixed-size pages to sequences; all-or-nothing growth."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages > 0 and page_size > 0, f"need positive num_pages/page_size, got {num_pages}/{page_size}"
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # stack; pops low ids first
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_missing(self, seq_id: int, new_len: int) -> int:
        """Pages `reserve(seq_id, new_len)` would take from the free list."""
        have = len(self._pages.get(seq_id, ()))
        return max(0, self.pages_for(new_len) - have)

    def can_reserve(self, seq_id: int, new_len: int) -> bool:
        return self.pages_missing(seq_id, new_len) <= len(self._free)

    def reserve(self, seq_id: int, new_len: int) -> None:
        """Grow `seq_id` (created on first use) to hold `new_len` tokens; CapacityError if out of pages."""
        old_len = self._lens.get(seq_id, 0)
        assert new_len >= old_len, f"reserve never shrinks: seq {seq_id} holds {old_len}, asked {new_len}"
        missing = self.pages_missing(seq_id, new_len)
        if missing > len(self._free):
            raise CapacityError(
                f"KV cache full: sequence {seq_id} needs {missing} more pages of {self.page_size} tokens, "
                f"{len(self._free)} of {self.num_pages} free"
            )
        pages = self._pages.setdefault(seq_id, [])
        for _ in range(missing):
            pages.append(self._free.pop())
        self._lens[seq_id] = new_len

    def free(self, seq_id: int) -> None:
        """Return all pages of `seq_id`; NotFoundError for an unknown sequence."""
        if seq_id not in self._pages:
            raise NotFoundError(f"sequence {seq_id} holds no KV pages")
        self._free.extend(reversed(self._pages.pop(seq_id)))
        del self._lens[seq_id]

    def page_table(self, seq_id: int) -> list[int]:
        if seq_id not in self._pages:
            raise NotFoundError(f"sequence {seq_id} holds no KV pages")
        return list(self._pages[seq_id])

    def seq_len(self, seq_id: int) -> int:
        if seq_id not in self._lens:
            raise NotFoundError(f"sequence {seq_id} holds no KV pages")
        return self._lens[seq_id]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def active_seqs(self) -> list[int]:
        return list(self._pages)


def physical_memory_bytes() -> int:
    """This machine's RAM (bytes; POSIX), or no bound where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return 2**63


class KVPool:
    """K and V page tensors for every layer: [L, P, page_size, Hkv, D] each."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        nbytes = 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        refusal = (f"the KV cache ({num_pages} pages: {nbytes / 2**30:.1f} GiB) does not fit on {device}; "
                   "use fewer pages (--kv-pages)")
        if torch.device(device).type == "cpu" and nbytes > physical_memory_bytes():  # Linux would overcommit it
            raise ConfigError(refusal)
        try:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except RuntimeError as e:  # torch.OutOfMemoryError on CUDA; the CPU allocator's "can't allocate memory"
            raise ConfigError(f"{refusal} ({str(e).splitlines()[0][:200]})") from None

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class KVCache:
    """Pool + allocator: what `Talker.forward` reads and writes."""

    pool: KVPool
    allocator: PageAllocator

    def __post_init__(self) -> None:
        assert self.pool.num_pages == self.allocator.num_pages, "pool and allocator disagree on page count"
        assert self.pool.page_size == self.allocator.page_size, "pool and allocator disagree on page size"

    @classmethod
    def create(
        cls,
        cfg: BackboneConfig,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        return cls(pool, PageAllocator(num_pages, page_size))

    @staticmethod
    def bytes_per_page(cfg: BackboneConfig, page_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    def layout(self, seq_ids: Sequence[int], qo_lens: Sequence[int]) -> PagedLayout:
        """Attention layout for a step whose new tokens are the last qo_lens[b] reserved ones."""
        alloc = self.allocator
        return PagedLayout.build(
            page_tables=[alloc.page_table(s) for s in seq_ids],
            kv_lens=[alloc.seq_len(s) for s in seq_ids],
            qo_lens=qo_lens,
            page_size=alloc.page_size,
            device=self.pool.k.device,
        )
