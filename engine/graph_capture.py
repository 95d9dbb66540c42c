"""CUDA-graph capture of one body per bucket (shared by the talker's decode/prefill graphs and the
codec graphs): stage dummy inputs, warm up on a side stream, capture into one memory pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

K = TypeVar("K")  # a bucket key: a batch size, or (batch, frames) for the codec


def capture_buckets(buckets: Sequence[K], stage_dummy: Callable[[K], None], body: Callable[[K], Any],
                    device: torch.device | None = None, stream: torch.cuda.Stream | None = None,
                    pool: Any = None) -> tuple[dict[K, torch.cuda.CUDAGraph], dict[K, Any]]:
    """Capture `body(b)` for every bucket key, largest first, into one shared memory pool.

    Each bucket's static inputs are filled with `stage_dummy(b)` and the body runs twice on a side
    stream first (lazy initialisation must not happen inside capture). Returns (graphs, outputs):
    replaying graphs[b] refreshes the tensors in outputs[b]. Used by the decode and prefill graphs
    here and by the codec graphs (stream/codec_graphs.py). `stream`: warm up and capture on it (a
    stream of a green context: the graphs' kernels keep to its SMs), else on side streams. `pool`: that
    memory pool (`torch.cuda.graph_pool_handle()`), else a new one.
    """
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graphs: dict[K, torch.cuda.CUDAGraph] = {}
    outputs: dict[K, Any] = {}
    for b in sorted(buckets, reverse=True):
        stage_dummy(b)
        side = stream or torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                body(b)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outputs[b] = body(b)
        graphs[b] = graph
    torch.cuda.synchronize(device)
    return graphs, outputs
