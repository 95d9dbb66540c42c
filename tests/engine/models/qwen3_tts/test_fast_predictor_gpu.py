"""The code predictor's frame attention on CUDA in bf16 at the 1.7B predictor's shape (16 query heads, 8 K/V heads,
head_dim 128): the Triton paged decode over the FrameLayout equals attention over copied heads, at the first
sub-step (2 causal rows a stream) and later ones; the layout is built and the kernel run inside a CUDA graph's capture
(as the frame step's graph does: nothing may wait for the device there)."""

import pytest
import torch

from higgs_stream.engine.models.qwen3_tts.fast_predictor import FrameAttention, FrameLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("g", [1, 8, 15])
def test_the_kernel_equals_copied_heads(g, copied_heads):
    b, hq, hkv, d = 8, 16, 8, 128
    t = 2 if g == 1 else 1
    q = torch.randn(b * t, hq, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, 16, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    attn = FrameAttention(FrameLayout(b, 16, "cuda").csr(g), d, fast=True)
    got = attn.run(q, k_cache, v_cache)
    want = copied_heads(q.float(), k_cache.float(), v_cache.float(), t, g + 1, hq, hkv, d)
    assert (got.float() - want).abs().max().item() < 3e-2  # bf16 inputs, probabilities and output, O(1) values
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = FrameAttention(FrameLayout(b, 16, "cuda").csr(g), d, fast=True).run(q, k_cache, v_cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, got)  # the same kernel on the same inputs
