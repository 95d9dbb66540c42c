"""engine/gemv_choice.py on the GPU: `measure` times both ways on the device, and a chosen shape's linear (the
CUDA-core GEMV over a plain bf16 weight, with a bias) tracks the exact product, with a row's result the same in any
batch of 1-4 rows."""

from __future__ import annotations

import math

import pytest
import torch

from higgs_stream.engine import gemv_choice as gc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_measure_times_both_ways_and_applies_the_margin():
    weights = [torch.randn(1024, 2048, device="cuda").bfloat16(), torch.randn(512, 512, device="cuda").bfloat16(),
               torch.randn(1024, 2048, device="cuda").bfloat16()]
    choice = gc.measure(weights, 2, torch.bfloat16, torch.device("cuda"))
    assert choice.max_rows == 2 and len(choice.timings) == 4  # 2 distinct shapes x 2 row counts
    for t in choice.timings:
        assert 0 < t["cublas_us"] < 1e4 and 0 < t["gemv_us"] < 1e4 and math.isfinite(t["gemv_us"]), t
    for shape in ((1024, 2048), (512, 512)):
        rows = [t for t in choice.timings if (t["n"], t["k"]) == shape]
        won = sum(t["gemv_us"] for t in rows) <= gc.MARGIN * sum(t["cublas_us"] for t in rows)
        assert (shape in choice.shapes) == won
    print("timed:", [(t["n"], t["k"], t["m"], round(t["cublas_us"], 1), round(t["gemv_us"], 1))
                     for t in choice.timings], "GEMV for", sorted(choice.shapes))


@pytest.mark.parametrize("n, k", [(1024, 2048), (768, 512), (300, 6144)])
def test_a_chosen_linear_tracks_the_exact_product_and_is_the_same_in_any_batch(n, k):
    """bf16 in and out, fp32 sums: max |y - exact| <= 2^-8 of the output's peak (its bf16 rounding) at 1-4 rows, with
    and without the bias, N not a multiple of the block (300); each row alone equals itself in the batch, bit for
    bit."""
    g = torch.Generator(device="cuda").manual_seed(n)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    b = torch.randn(n, generator=g, device="cuda").bfloat16()
    x = torch.randn(4, k, generator=g, device="cuda").bfloat16()
    choice = gc.GemvChoice(frozenset({(n, k)}), 4)
    for bias in (None, b):
        full = choice.linear(x, w, bias)
        for m in range(1, 5):
            y = choice.linear(x[:m], w, bias)
            exact = x[:m].double() @ w.double().t() + (0 if bias is None else bias.double())
            assert float((y.double() - exact).abs().max() / exact.abs().max()) <= 2**-8
            assert torch.equal(y, full[:m]), (m, bias is not None)
    assert torch.equal(choice.linear(x[None, :2], w, b)[0], full[:2])  # leading dims


def test_compile_ahead_files_the_variants_the_timing_then_launches():
    """`compile_plain_gemv` compiles the (rows, N, K) variants without launching them, under the keys real calls
    compute: the calls after it add no kernel to the cache, and compute the product (an N and K no other test uses,
    so the compiles are this test's)."""
    from higgs_stream.kernels import int8_linear

    n, k = 1040, 1216
    cache = int8_linear._gemv_kernel().device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    int8_linear.compile_plain_gemv([(m, n, k) for m in (1, 2, 3)], torch.bfloat16, workers=3)
    assert len(cache) == before + 3
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    for m in (1, 2, 3):
        x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        y = int8_linear.triton_gemv(x, w, None, int8_linear.plain_gemv_blocks(k))
        exact = x.double() @ w.double().t()
        assert (y.double() - exact).abs().max().item() <= 2 ** -8 * exact.abs().max().item()
    assert len(cache) == before + 3  # nothing compiled by the launches
