"""The Triton paged decode attention on the GPU over bf16 and e4m3 pages: equal to its fp32 definition on the
same (already rounded) pages within the bf16 rounding of queries, probabilities and outputs, at every block
size and pipeline depth the benchmark sweeps; and against FlashInfer's decode on the same pages."""

import pytest
import torch

from higgs_stream.kernels.attention import FP8_KV, PagedLayout
from higgs_stream.kernels.flashinfer_attention import FlashInferAttention, HostCSR
from higgs_stream.kernels.paged_decode import paged_decode, paged_decode_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def setup(pool_dtype, hq=24, hkv=8, d=128, ps=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [1, 16, 17, 300, 1000, 45]
    perm, tables, at = torch.randperm(256, generator=g).tolist(), [], 0
    for n in lens:
        tables.append(perm[at:at + -(-n // ps)])
        at += len(tables[-1])
    k = (torch.randn(256, ps, hkv, d, generator=g) * 2).to(pool_dtype).cuda()
    v = (torch.randn(256, ps, hkv, d, generator=g) * 2).to(pool_dtype).cuda()
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16().cuda()
    return q, k, v, PagedLayout.build(tables, lens, [1] * len(lens), ps, "cuda")


@pytest.mark.parametrize("pool", [torch.bfloat16, FP8_KV])
@pytest.mark.parametrize("params", [(16, 4, 1, None), (64, 4, 1, None), (64, 2, 1, None), (128, 8, 3, None),
                                    (64, 4, 1, 1), (64, 4, 1, 4), (64, 4, 1, 16), (64, 4, 1, "auto")])
def test_matches_definition(pool, params):
    """Whole (None) and ranged (programs per sequence and head; "auto": decode_splits) forms."""
    q, k, v, lay = setup(pool)
    csr = (lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len)
    want = paged_decode_ref(q.float(), k, v, *csr, 128 ** -0.5)  # fp32 math over the same pages
    block_n, warps, stages, programs = params
    ranged = {} if programs is None else {"max_kv_len": 1024, "programs": None if programs == "auto" else programs}
    got = paged_decode(q, k, v, *csr, 128 ** -0.5, block_n=block_n, num_warps=warps, num_stages=stages, **ranged)
    err = (got.float() - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-2, err  # 16-bit probabilities and output: ~0.4 % of the peak


@pytest.mark.parametrize("pool", [torch.bfloat16, FP8_KV])
def test_the_ranged_form_is_batch_invariant(pool):
    """The ranged form, compiled: every sequence alone (its own CSR, a batch of one, decode_splits' 16 programs) and
    the six together at 1, 4 and 16 programs give the same bits; in a graph too."""
    q, k, v, lay = setup(pool, seed=3)
    csr = (lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len)
    together = [paged_decode(q, k, v, *csr, 128 ** -0.5, max_kv_len=1024, programs=p) for p in (1, 4, 16)]
    assert all(torch.equal(together[0], t) for t in together[1:])
    for i in range(q.shape[0]):
        one = PagedLayout.build([lay.page_tables[i]], [lay.kv_lens[i]], [1], 16, "cuda")
        alone = paged_decode(q[i:i + 1].contiguous(), k, v, one.kv_indptr, one.kv_indices, one.kv_last_page_len,
                             128 ** -0.5, max_kv_len=1024)
        assert torch.equal(alone[0], together[0][i]), i
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(q, k, v, *csr, 128 ** -0.5, out=out, max_kv_len=1024)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, together[0])


def test_agrees_with_flashinfer_on_fp8_pages():
    q, k, v, lay = setup(FP8_KV, seed=2)
    fi = FlashInferAttention(24, 8, 128, 16, torch.device("cuda"), kv_dtype=FP8_KV)
    fi.plan(HostCSR.from_layout(lay), decode=True)
    theirs = fi.run(q, k, v).float()
    ours = paged_decode(q, k, v, lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len, 128 ** -0.5).float()
    assert (ours - theirs).abs().max().item() / theirs.abs().max().item() < 1e-2


@pytest.mark.parametrize("programs", [None, 16])
def test_e4m3_words_widen_every_value_exactly(programs):
    """The served form over e4m3 pages (V as 4-byte words, widened where loaded): a sequence of one token returns
    that token's V row, so every finite e4m3 value at every byte of a word comes back exactly (bf16 holds each),
    for all 24 query heads of its K/V head; whole and ranged."""
    n = 256  # sequences, one token each, one page of one token each
    bits = torch.arange(n * 8 * 128, dtype=torch.int32).remainder(256).to(torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # e4m3fn's NaNs
    v = bits.view(FP8_KV).reshape(n, 1, 8, 128).cuda()
    k = torch.randn(n, 1, 8, 128).to(FP8_KV).cuda()
    q = torch.randn(n, 24, 128).bfloat16().cuda()
    lay = PagedLayout.build([[i] for i in range(n)], [1] * n, [1] * n, 1, "cuda")
    ranged = {} if programs is None else {"max_kv_len": 64, "programs": programs}
    got = paged_decode(q, k, v, lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len, 128 ** -0.5, **ranged)
    want = v.float().reshape(n, 8, 1, 128).expand(n, 8, 3, 128).reshape(n, 24, 128)
    assert torch.equal(got.float(), want)


def test_the_two_e4m3_forms_agree():
    """V as words with fp16 operands (served) and the pages cast to bf16 (the benchmark's baseline) on the same pages:
    both within the definition's bound, and within 16-bit rounding of each other."""
    q, k, v, lay = setup(FP8_KV, seed=4)
    csr = (lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len)
    want = paged_decode_ref(q.float(), k, v, *csr, 128 ** -0.5)
    words, cast = (paged_decode(q, k, v, *csr, 128 ** -0.5, fp8_words=w).float() for w in (True, False))
    peak = want.abs().max().item()
    assert (words - want).abs().max().item() / peak < 1e-2
    assert (cast - want).abs().max().item() / peak < 1e-2
    assert (words - cast).abs().max().item() / peak < 1e-2
