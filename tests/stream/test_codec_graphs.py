"""CodecGraphs on CUDA (the low-latency ramp windows): replays run the eager decode's kernels at the same
shapes, so they equal it exactly on one device; other shapes run eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.codec import CodecConfig
from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.random_weights import random_codec
from higgs_stream.stream.adapter import Code2WavAdapter, WindowJob, decode_windows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_replays_equal_the_eager_decode():
    from higgs_stream.stream.codec_graphs import CodecGraphs

    codec = random_codec(CodecConfig.tiny())
    graphs = CodecGraphs(codec, [(1, 16), (2, 24), (4, 48)])
    assert graphs.capture() == 0.0
    rng = np.random.default_rng(1)
    for shape in ((1, 8, 16), (2, 8, 24), (4, 8, 48), (3, 8, 20)):
        codes = torch.from_numpy(rng.integers(0, 1024, size=shape))
        assert torch.equal(graphs.decode(codes).clone(), codec.decode(codes))
    assert graphs.replays == 3 + 1  # the capture check replays once; (3, 20) ran eagerly
    with pytest.raises(InvalidInputError):
        graphs.decode(torch.full((1, 8, 16), 1024))
    # the low-latency ramp windows (what CodecGraphs serves) are the same with and without graphs
    frames = rng.integers(0, 1024, size=(8, 60))
    a, jobs = Code2WavAdapter(codec.geometry, mode="low_latency"), []
    for i in range(frames.shape[1]):
        a.feed(frames[:, i], final=i == frames.shape[1] - 1)
        jobs += [j for j in a.take_jobs() if isinstance(j, WindowJob)]
    assert len(jobs) == 5  # the ramp
    out = [decode_windows(fn, codec.hop, jobs, batch_buckets=(1, 2, 4)) for fn in (graphs.decode, codec.decode)]
    assert all(np.array_equal(x, y) for x, y in zip(*out))  # same kernels, same shapes
