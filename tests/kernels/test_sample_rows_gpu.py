"""The compiled fused draw (kernels/sample_rows.py) == its plain-torch reference on CUDA at the vocabularies
the engine samples (Higgs v2 heads 1026, the Qwen3-TTS code predictor 2048, its talker head 3072),
for rows the reference does not leave to rounding or tie order; and it replays from a CUDA graph."""

import pytest
import torch

from higgs_stream.kernels.sample_rows import sample_rows, sample_rows_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("b,h,v", [(64, 8, 1026), (128, 1, 2048), (32, 1, 3072), (1, 1, 2048)])
def test_matches_ref(b, h, v, sampling_cases):
    params, ambiguous = sampling_cases
    g = torch.Generator(device="cuda").manual_seed(v)
    logits = torch.randn(b, h, v, device="cuda", generator=g) * 3
    noise = torch.empty(b, h, v, device="cuda").exponential_(generator=g)
    p = {k: x.cuda() for k, x in params(b, v, seed=b).items()}
    logits[0, 0, 5] = float("nan")
    got, finite = sample_rows(logits, noise, **p)
    want, want_finite = sample_rows_ref(logits, noise, **p)
    assert torch.equal(finite, want_finite) and int((~finite).sum()) == 1
    skip = ambiguous(torch.where(want_finite[..., None], logits, 0.0), noise, p)
    assert int((~skip).sum()) >= 0.9 * (b * h - 1)
    assert torch.equal(got[~skip], want[~skip])


def test_strided_rows_and_graph_replay(sampling_cases):
    """The head's noise is a strided view ([B, 2, h, V][:, 0]); a captured draw replays with new inputs."""
    params, ambiguous = sampling_cases
    b, h, v = 16, 8, 1026
    logits = torch.randn(b, h, v, device="cuda")
    noise = torch.empty(b, 2, h, v, device="cuda").exponential_()
    p = {k: x.cuda() for k, x in params(b, v, seed=3).items()}
    sample_rows(logits, noise[:, 0], **p, clean=False)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, none = sample_rows(logits, noise[:, 0], **p, clean=False)
    for seed in range(3):
        logits.copy_(torch.randn(b, h, v, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        want, _ = sample_rows_ref(logits, noise[:, 0], **p, clean=False)
        skip = ambiguous(logits, noise[:, 0].contiguous(), p)
        assert none is None and torch.equal(tokens[~skip], want[~skip])
