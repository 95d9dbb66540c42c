"""The codec's decode replayed from CUDA graphs at a fixed set of (batch, frames) shapes.

A small codec call (a first chunk, a step with a few due windows) is bound by launching ~300
kernels, not by the device: 4-10 ms of host time for well under 1 ms of GPU work. `CodecGraphs`
captures `Codec.decode_codes` once per shape and replays it; other shapes run the codec eagerly
(the shape decides, never an error). A replay runs the same kernels as the eager call, so the
samples are the same (`capture()` checks one shape against the eager decode and refuses a graph
that differs: the pipeline then decodes eagerly and logs an error).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.graph_capture import capture_buckets


class CodecGraphs:
    """Wraps a CUDA `Codec`; `decode(codes)` = `codec.decode(codes)`, from a graph when one was
    captured at that shape. The returned tensor of a replay is the graph's buffer: valid until
    the next call (the adapter copies it to the host at once)."""

    def __init__(self, codec, shapes: Iterable[tuple[int, int]]) -> None:
        self.codec = codec
        self.hop, self.receptive_field = int(codec.hop), int(codec.receptive_field)
        self.sample_rate = getattr(codec, "sample_rate", None)
        self.device = codec.device
        assert self.device.type == "cuda", f"codec graphs need a CUDA codec, it is on {self.device}"
        self.shapes = sorted(set(shapes))
        self.codebook_size = int(codec.cfg.codebook_size)
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.check_max_abs_diff: float | None = None

    def capture(self, stream: torch.cuda.Stream | None = None) -> float:
        """Capture every shape (largest first, one memory pool), then compare one replay with the
        eager decode on random codes; returns the max |difference| (0.0 expected). A caller that
        gets anything else must not use the graphs."""
        k = self.codec.num_codebooks

        def stage(shape: tuple[int, int]) -> None:
            b, f = shape
            self._inputs[shape] = torch.zeros((b, k, f), dtype=torch.long, device=self.device)

        with torch.no_grad():
            self._graphs, self._outputs = capture_buckets(
                self.shapes, stage, lambda shape: self.codec.decode_codes(self._inputs[shape]), self.device, stream)
            if self.shapes:
                b, f = self.shapes[0]
                probe = torch.randint(0, self.codebook_size, (b, k, f), generator=torch.Generator().manual_seed(0))
                got = self.decode(probe).clone()
                want = self.codec.decode(probe)
                self.check_max_abs_diff = float((got - want).abs().max())
        torch.cuda.synchronize(self.device)
        return self.check_max_abs_diff or 0.0

    def decode(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor:
        """codes [B, Q, F] ints in 0..codebook_size-1 -> waveform [B, F * hop] float32 (device)."""
        codes = torch.as_tensor(codes)
        key = (int(codes.shape[0]), int(codes.shape[2])) if codes.dim() == 3 else None
        graph = self._graphs.get(key)
        if graph is None:
            return self.codec.decode(codes)
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise InvalidInputError(f"codes must be integers, got {codes.dtype}")
        host = codes.cpu()
        if host.numel() and (int(host.min()) < 0 or int(host.max()) >= self.codebook_size):
            raise InvalidInputError(f"codes must lie in 0..{self.codebook_size - 1}")
        self._inputs[key].copy_(host)
        graph.replay()
        self.replays += 1
        return self._outputs[key]
