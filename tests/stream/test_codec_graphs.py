"""CodecGraphs on CUDA: replays equal the eager decode bit for bit; other shapes run eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from higgs_stream.engine.codec import Codec, CodecConfig
from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.stream.adapter import Code2WavAdapter, decode_jobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_replays_equal_the_eager_decode():
    from higgs_stream.stream.codec_graphs import CodecGraphs

    torch.manual_seed(0)
    codec = Codec(CodecConfig.tiny(), with_encoder=False)
    with torch.no_grad():
        for name, buf in codec.named_buffers():
            if name.endswith("codebook.embed"):
                buf.normal_()
    codec = codec.cuda().eval()
    graphs = CodecGraphs(codec, [(1, 16), (2, 24), (4, 48)])
    assert graphs.capture() == 0.0
    rng = np.random.default_rng(1)
    for shape in ((1, 8, 16), (2, 8, 24), (4, 8, 48), (3, 8, 20)):
        codes = torch.from_numpy(rng.integers(0, 1024, size=shape))
        assert torch.equal(graphs.decode(codes).clone(), codec.decode(codes))
    assert graphs.replays == 3 + 1  # the capture check replays once; (3, 20) ran eagerly
    with pytest.raises(InvalidInputError):
        graphs.decode(torch.full((1, 8, 16), 1024))
    # through the adapter: a stream's chunks are the same with and without graphs
    cols = np.concatenate([np.full((8, 1), 1024), rng.integers(0, 1024, size=(8, 60)), np.full((8, 1), 1025)], axis=1)
    from higgs_stream.engine.delay import build_delay_pattern

    cols = build_delay_pattern(cols)
    out = []
    for dec in (graphs, codec):
        a, chunks = Code2WavAdapter(dec), []
        for i in range(cols.shape[1]):
            a.feed(cols[:, i], final=i == cols.shape[1] - 1)
            if (job := a.take_job()) is not None:
                chunks += decode_jobs(dec, [job], batch_buckets=(1, 2, 4), length_quantum=8)
        out.append(np.concatenate(chunks))
    assert np.array_equal(out[0], out[1])
