"""FlashInfer paged decode / prefill == paged_attention_ref on a fragmented pool (CUDA only)."""

import pytest
import torch

from higgs_stream.kernels.attention import PagedLayout, paged_attention_ref
from higgs_stream.kernels.flashinfer_attention import FlashInferAttention, GraphDecodeAttention, HostCSR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HQ, HKV, D, PS = 24, 8, 128, 16


def setup(kv_lens, qo_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = 256
    perm = torch.randperm(pages, generator=gen).tolist()
    tables, at = [], 0
    for kv in kv_lens:
        n = -(-kv // PS)
        tables.append(perm[at:at + n])
        at += n
    k = torch.randn(pages, PS, HKV, D, generator=gen).bfloat16().cuda()
    v = torch.randn(pages, PS, HKV, D, generator=gen).bfloat16().cuda()
    q = torch.randn(sum(qo_lens), HQ, D, generator=gen).bfloat16().cuda()
    layout = PagedLayout.build(tables, kv_lens, qo_lens, PS, "cuda")
    return q, k, v, layout


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("decode", [True, False])
def test_matches_ref(decode):
    kv_lens = [1, 17, 160, 333, 48]
    qo_lens = [1] * 5 if decode else [1, 9, 160, 5, 48]
    q, k, v, layout = setup(kv_lens, qo_lens)
    want = paged_attention_ref(q, k, v, layout, D**-0.5)
    attn = FlashInferAttention(HQ, HKV, D, PS, torch.device("cuda"))
    attn.plan(HostCSR.from_layout(layout), decode=decode)
    assert rel(attn.run(q, k, v), want) < 1e-2


@pytest.mark.parametrize("kernel", ["cuda_cores", "tensor_cores", "triton"])
def test_graph_decode_replay_matches_ref(kernel):
    """Both of FlashInfer's decode kernels (CUDA cores; tensor cores: its prefill kernel at qo_len 1) and our
    Triton kernel, each captured once and replayed over a new plan."""
    kv_lens = [40, 7, 250]
    q, k, v, layout = setup(kv_lens, [1, 1, 1], seed=3)
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    attn = GraphDecodeAttention(4, 64, HQ, HKV, D, PS, torch.device("cuda"), ws, kernel=kernel)
    q4 = torch.cat([q, torch.zeros(1, HQ, D, dtype=q.dtype, device="cuda")])
    pad = layout.page_tables + [[0]]
    attn.plan(HostCSR.build(pad, kv_lens + [1], [1] * 4, PS))
    static_q = q4.clone()
    graph = torch.cuda.CUDAGraph()
    attn.run(static_q, k, v)
    with torch.cuda.graph(graph):
        out = attn.run(static_q, k, v)
    # re-plan for other lengths and replay: the graph must follow the new plan
    kv2 = [60, 3, 200]
    q2, _, _, layout2 = setup(kv2, [1, 1, 1], seed=3)
    static_q[:3] = q2
    attn.plan(HostCSR.build(layout2.page_tables + [[0]], kv2 + [1], [1] * 4, PS))
    graph.replay()
    want = paged_attention_ref(q2, k, v, layout2, D**-0.5)
    assert rel(out[:3], want) < 1e-2

