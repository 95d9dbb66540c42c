"""Int8 weight-only linear on the CPU: the definition vs the dense fp32 product (a derived bound),
ATen's int8 kernels (the CPU fast path: vectorized bf16 for K % 16 == 0, scalar fp32 otherwise) vs
the definition, and the CUDA Triton kernel's indexing run through Triton's interpreter on the CPU
(fp32; the compiled kernel is checked in *_gpu.py)."""

from __future__ import annotations


import pytest
import torch

from higgs_stream.engine.quantize import quantize_weight
from higgs_stream.kernels.int8_linear import cpu_vectorized, int8_linear, int8_linear_ref


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * (0.5 + torch.rand(n, 1, generator=g))  # rows of different scale


def test_definition_is_within_half_a_step_per_weight():
    """|y - x @ w^T| <= sum_k |x_k| * scale_n / 2 (each int8 weight is within half a step of w), plus fp32 slack."""
    w, x = weights(48, 96), torch.randn(5, 96)
    qw = quantize_weight(w, "int8")
    assert qw.qweight.dtype == torch.int8 and qw.scale.dtype == torch.float32 and qw.scale.shape == (48,)
    assert qw.qweight.abs().max() == 127  # the largest |w| of a row maps to 127
    assert ((qw.dequantize() - w).abs() <= qw.scale[:, None] / 2 * (1 + 1e-6)).all()
    got, dense = int8_linear_ref(x, qw.qweight, qw.scale), x @ w.t()
    bound = x.abs() @ (qw.scale[:, None] / 2).expand_as(w).t() + 1e-5 * (x.abs() @ w.abs().t())
    assert ((got - dense).abs() <= bound).all()


@pytest.mark.parametrize("m, n, k", [(1, 5, 7), (3, 48, 64), (17, 130, 96), (2, 300, 33), (4, 64, 3072)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_the_definition(m, n, k, dtype):
    """ATen's `_weight_int8pack_mm` vs the fp32 definition, elementwise against |x| @ |w|^T: K a
    multiple of 16 takes its vectorized bf16 kernel (activations and the unscaled sums each rounded to
    bf16 once: 2 * 2^-9), any other K its scalar fp32 kernel (fp32 rounding); bf16 outputs, both
    rounded from fp32 values that differ slightly, may land one bf16 step (2^-8) apart."""
    qw = quantize_weight(weights(n, k), "int8")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)).to(dtype)
    got, want = int8_linear(x, qw.qweight, qw.scale), int8_linear_ref(x, qw.qweight, qw.scale)
    assert got.shape == (m, n) and got.dtype == dtype and torch.isfinite(got).all()
    rel = (2 * 2.0**-9 if cpu_vectorized(k, qw.qweight) else 1e-5) + (2.0**-8 if dtype == torch.bfloat16 else 0)
    assert ((got.float() - want.float()).abs() <= rel * (x.float().abs() @ qw.dequantize().abs().t()) + 1e-6).all()


def test_cpu_kernel_choice_follows_k_and_alignment():
    q = torch.zeros(8, 64, dtype=torch.int8)
    assert cpu_vectorized(64, q) and not cpu_vectorized(72, torch.zeros(8, 72, dtype=torch.int8))
    x = torch.randn(3, 65)[:, 1:]  # a view whose rows start off the 64-byte grid: copied before the kernel
    qw = quantize_weight(weights(16, 64), "int8")
    torch.testing.assert_close(int8_linear(x, qw.qweight, qw.scale), int8_linear(x.clone(), qw.qweight, qw.scale),
                               rtol=0, atol=0)


def test_leading_dims_and_empty_batch():
    qw = quantize_weight(weights(8, 16), "int8")
    x = torch.randn(2, 3, 16)
    assert int8_linear(x, qw.qweight, qw.scale).shape == (2, 3, 8)
    assert int8_linear(torch.zeros(0, 16), qw.qweight, qw.scale).shape == (0, 8)


SCRIPT = r"""
import json, torch
from higgs_stream.kernels import int8_linear as m
kernel = m.build_kernel()
errs = []
for rows, n, k in [(1, 40, 300), (5, 64, 128), (16, 33, 129), (17, 70, 72), (40, 130, 256)]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g)
    out = torch.full((rows, n), float("nan"))
    m.launch(kernel, x, q, s, out)
    want = m.int8_linear_ref(x, q, s)
    errs.append(((out - want).abs().max() / (x.abs() @ q.float().abs().t() * s).max()).item())
print(json.dumps(errs))
"""


def test_triton_kernel_in_the_interpreter(interpret):
    """The CUDA kernel's tiling, masks (M, N and K tails) and scale epilogue, run by Triton's
    interpreter on the CPU in fp32 (a subprocess: TRITON_INTERPRET must be set before Triton loads)."""
    errs = interpret(SCRIPT)
    assert len(errs) == 5 and max(errs) < 1e-6, errs  # every output written (no NaN left), fp32 rounding only


GEMV_SCRIPT = r"""
import json, torch
from higgs_stream.kernels import int8_linear as m
from higgs_stream.kernels.fp8_linear import FP8, fp8_linear_ref
from higgs_stream.engine.quantize import quantize_weight
kernel = m.build_gemv_kernel()
out_rows = []
for rows, n, k, bn, bk in [(1, 40, 300, 16, 128), (2, 64, 128, 16, 64), (3, 33, 129, 32, 64), (4, 70, 1030, 16, 512)]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g)
    out = torch.full((rows, n), float("nan"))
    m.launch_gemv(kernel, x, q, s, out, (bn, bk, 4, 1))
    want = m.int8_linear_ref(x, q, s)
    err_int8 = ((out - want).abs().max() / (x.abs() @ q.float().abs().t() * s).max()).item()
    fq = quantize_weight(torch.randn(n, k, generator=g) * 0.02, "fp8")
    out8 = torch.full((rows, n), float("nan"))
    m.launch_gemv(kernel, x, fq.qweight, fq.scale, out8, (bn, bk, 4, 1))
    want8 = fp8_linear_ref(x, fq.qweight, fq.scale)
    err_fp8 = ((out8 - want8).abs().max() / want8.abs().max()).item()
    one = torch.full((1, n), float("nan"))  # row 0 alone: the same sums as in the batch
    m.launch_gemv(kernel, x[:1].contiguous(), q, s, one, (bn, bk, 4, 1))
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)  # a float weight, unscaled, with a bias
    outf = torch.full((rows, n), float("nan"))
    m.launch_gemv(kernel, x, w, None, outf, (bn, bk, 4, 1), bias=b)
    wantf = x.double() @ w.double().t() + b.double()
    err_float = ((outf.double() - wantf).abs().max() / (x.abs().double() @ w.abs().double().t()).max()).item()
    out_rows.append([err_int8, err_fp8, bool(torch.equal(one[0], out[0])), err_float])
print(json.dumps(out_rows))
"""


def test_gemv_kernel_in_the_interpreter(interpret):
    """The CUDA-core GEMV (`triton_gemv`, 1-4 rows) over int8 and e4m3 weights: its N and K tails, the padded row
    count (3 rows in a block of 4), the scale epilogue, against the definitions in fp32; row 0 computed alone equals
    row 0 in a batch, bit for bit (each row its own reduction of the same tile); and a float weight, unscaled, with a
    bias (the plain linears engine/gemv_choice.py routes to it) against the fp64 product, to fp32 rounding."""
    for err_int8, err_fp8, alone_equal, err_float in interpret(GEMV_SCRIPT):
        assert err_int8 < 1e-6 and err_fp8 < 1e-5 and alone_equal and err_float < 1e-6, \
            (err_int8, err_fp8, alone_equal, err_float)


@pytest.mark.parametrize("weights, rows, k, blocks", [("*fp8e4nv", 1, 3072, (16, 1024, 4, 3)),
                                                      ("*i8", 4, 3072, (16, 512, 4, 3)),
                                                      ("*fp8e4nv", 1, 3072, (32, 2048, 8, 2)),
                                                      ("*fp8e4nv", 2, 3072, "served"), ("*fp8e4nv", 2, 8192, "served"),
                                                      ("*bf16", 1, 2048, "served"), ("*bf16", 4, 6144, "served")])
def test_gemv_kernel_compiles_for_hopper(weights, rows, k, blocks, compile_for_hopper):
    """The GEMV compiles for sm_90 (no GPU needed) at the tile sizes scripts/sweep_gemv.py starts from and at the
    served ones (`gemv_blocks`), over v2's K = 3072 and 8192 and, for plain bf16 weights (unscaled, with a bias:
    engine/gemv_choice.py), Qwen3-TTS's 2048 and 6144, with no register spills to local memory."""
    from higgs_stream.kernels import int8_linear as m

    plain = weights == "*bf16"
    bn, bk, warps, stages = (m.plain_gemv_blocks(k) if plain else m.gemv_blocks(k)) if blocks == "served" else blocks
    sig = {"x_ptr": "*bf16", "q_ptr": weights, "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32",
           "N": "i32",
           **dict.fromkeys(("K", "ROWS", "ROWS_PAD", "BLOCK_N", "BLOCK_K", "W_FLOAT", "SCALED", "BIAS"), "constexpr")}
    consts = {"K": k, "ROWS": rows, "ROWS_PAD": rows, "BLOCK_N": bn, "BLOCK_K": bk, "W_FLOAT": weights != "*i8",
              "SCALED": not plain, "BIAS": plain}
    compiled = compile_for_hopper(m.build_gemv_kernel(), sig, consts, num_warps=warps, num_stages=stages)
    assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"]


def test_gemv_blocks_follow_k_unless_a_benchmark_sets_one_for_all(monkeypatch):
    """K tiles of 1024 below K = 8192 and of 2048 from it (v2's down projection: faster on an H100 and an H200);
    a benchmark's GEMV_BLOCKS overrides every K, and a call's own `blocks` wins over both."""
    from higgs_stream.kernels import int8_linear as m

    assert m.gemv_blocks(3072) == (8, 1024, 4, 3) and m.gemv_blocks(8191) == (8, 1024, 4, 3)
    assert m.gemv_blocks(8192) == (8, 2048, 4, 3) and m.gemv_blocks(9728) == (8, 2048, 4, 3)
    monkeypatch.setattr(m, "GEMV_BLOCKS", (16, 512, 2, 2))
    assert m.gemv_blocks(3072) == m.gemv_blocks(8192) == (16, 512, 2, 2)
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: launched.append((grid, kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"]))

    x, q = torch.zeros(1, 8192), torch.zeros(64, 8192, dtype=torch.int8)
    m.launch_gemv(Kernel(), x, q, torch.ones(64), torch.zeros(1, 64))
    m.launch_gemv(Kernel(), x, q, torch.ones(64), torch.zeros(1, 64), (32, 1024, 4, 3))
    assert launched == [((4,), 16, 512, 2), ((2,), 32, 1024, 4)]


def test_plain_gemv_blocks_and_the_scale_contract():
    """Plain bf16 weights: K tiles of 2048 from K = 2048 (Qwen3-TTS's code predictor's o projection: 5.6 vs 7.9 us
    at one row with 1024, H200), 1024 below; a float weight takes no scale and an int8 / e4m3 one needs its own."""
    from higgs_stream.kernels import int8_linear as m

    assert m.plain_gemv_blocks(1024) == (8, 1024, 4, 3) and m.plain_gemv_blocks(2047) == (8, 1024, 4, 3)
    assert m.plain_gemv_blocks(2048) == (8, 2048, 4, 3) and m.plain_gemv_blocks(6144) == (8, 2048, 4, 3)
    x = torch.zeros(1, 64)
    with pytest.raises(AssertionError, match="a scale goes with"):
        m.triton_gemv(x, torch.zeros(8, 64), torch.ones(8))
    with pytest.raises(AssertionError, match="a scale goes with"):
        m.triton_gemv(x, torch.zeros(8, 64, dtype=torch.int8), None)
    with pytest.raises(AssertionError, match="bias must be"):
        m.triton_gemv(x, torch.zeros(8, 64), None, bias=torch.zeros(4))
