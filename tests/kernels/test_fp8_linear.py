"""FP8 (e4m3) linear, the plain-torch definitions on the CPU: per-row scales (max |x| -> 448), every
value within half an e4m3 step, and the emulated product within the bound those steps imply; the
CUDA quantization kernel's logic through Triton's interpreter."""

from __future__ import annotations


import pytest
import torch

from higgs_stream.engine.quantize import quantize_weight
from higgs_stream.kernels.fp8_linear import FP8, FP8_MAX, INV_FP8_MAX, fp8_linear_ref, quantize_per_token_ref

HALF_STEP_REL = 2.0**-4  # e4m3 normals: 3 mantissa bits, so rounding moves a value by <= 2^-4 of it
HALF_STEP_SUB = 2.0**-10  # subnormals (|v| < 2^-6): spacing 2^-9


def step_bound(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest rounding error of v (already in real units) quantized with per-row `scale` [R]."""
    return torch.maximum(v.abs() * HALF_STEP_REL, HALF_STEP_SUB * scale[:, None])


def test_per_token_scales_and_rounding():
    torch.manual_seed(0)
    x = torch.randn(6, 200) * torch.logspace(-3, 2, 6)[:, None]  # rows over five decades
    x[3] = 0.0  # an all-zero row: a tiny scale, zeros out
    xq, scale = quantize_per_token_ref(x)
    assert xq.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (6,)
    live = [0, 1, 2, 4, 5]
    assert torch.equal(xq.float()[live].abs().amax(1), torch.full((5,), FP8_MAX))  # max |x| -> 448 per row
    amax = x[live].abs().amax(1)
    assert torch.equal(scale[live], amax * INV_FP8_MAX)  # one fp32 product: the same on every device
    torch.testing.assert_close(scale[live], amax / FP8_MAX, rtol=2**-23, atol=0)  # = amax / 448 within 1 ulp
    assert not xq.float()[3].any() and scale[3] > 0
    err = (xq.float() * scale[:, None] - x).abs()
    assert (err <= step_bound(x, scale) * (1 + 1e-6)).all()


def test_weight_rows_quantize_like_tokens():
    torch.manual_seed(1)
    w = torch.randn(40, 64) * (0.1 + torch.rand(40, 1))
    qw = quantize_weight(w, "fp8")
    q, s = quantize_per_token_ref(w)
    assert qw.mode == "fp8" and torch.equal(qw.qweight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(qw.scale, s)


@pytest.mark.parametrize("gemv_max_m", [0, 16])
def test_emulated_product_is_within_the_rounding_bound(gemv_max_m):
    """w8a8 (7 rows > gemv_max_m 0): |x^ w^ - x w| <= e_x |w^| + |x| e_w, with e the per-element rounding
    bounds, plus fp32 slack; weight-only (7 rows <= 16): |x w^ - x w| <= |x| e_w."""
    torch.manual_seed(2)
    x, w = torch.randn(7, 96), torch.randn(33, 96) * 0.05
    qw = quantize_weight(w, "fp8")
    _, xs = quantize_per_token_ref(x)
    got, dense = fp8_linear_ref(x, qw.qweight, qw.scale, gemv_max_m=gemv_max_m), x @ w.t()
    bound = x.abs() @ step_bound(w, qw.scale).t()
    if gemv_max_m < x.shape[0]:
        bound = bound + step_bound(x, xs) @ qw.dequantize().abs().t()
    assert ((got - dense).abs() <= bound + 1e-5 * (x.abs() @ w.abs().t())).all()
    rel = ((got - dense).norm() / dense.norm()).item()
    assert 1e-3 < rel < 5e-2, rel  # quantized (not silently dense), and typical e4m3 error on random data


def test_the_weight_only_rows_are_read_at_each_call(monkeypatch):
    """fp8_linear.GEMV_MAX_M is read when the linear runs, not when it was defined (bench_quant
    --fp8-weight-only-rows sets it): 7 rows are weight-only at 16 (x w^, exact in fp32 here), w8a8 at 4."""
    from higgs_stream.kernels import fp8_linear as f

    torch.manual_seed(3)
    x, qw = torch.randn(7, 32), quantize_weight(torch.randn(9, 32), "fp8")
    weight_only = x @ qw.dequantize().t()
    assert torch.allclose(fp8_linear_ref(x, qw.qweight, qw.scale), weight_only, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(f, "GEMV_MAX_M", 4)
    w8a8 = fp8_linear_ref(x, qw.qweight, qw.scale)
    assert torch.equal(w8a8, fp8_linear_ref(x, qw.qweight, qw.scale, gemv_max_m=0))
    assert not torch.allclose(w8a8, weight_only, rtol=1e-3, atol=1e-3)  # the activations were quantized


def test_dtype_and_shapes_follow_the_activations():
    qw = quantize_weight(torch.randn(8, 16), "fp8")
    x = torch.randn(2, 3, 16).bfloat16()
    y = fp8_linear_ref(x, qw.qweight, qw.scale)
    assert y.shape == (2, 3, 8) and y.dtype == torch.bfloat16


SCRIPT = r"""
import json, torch
from higgs_stream.kernels import fp8_linear as f
kernel, out = f._kernel(), []
for m, k in [(1, 3072), (3, 100), (2, 2500), (4, 9728)]:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
    x[-1] = 0  # an all-zero row
    y, s = torch.full((m, k), float("nan")), torch.empty(m)
    kernel[(m,)](x, y, s, k, f.EPS, f.INV_FP8_MAX, f.FP8_MAX, BLOCK=1024, num_warps=4)  # fp32 out: the values before the cast
    want = x.abs().amax(1).clamp(min=f.EPS) * f.INV_FP8_MAX
    out.append([torch.equal(s, want), torch.equal(y, (x / want[:, None]).clamp(-f.FP8_MAX, f.FP8_MAX))])
print(json.dumps(out))
"""


def test_triton_quantization_in_the_interpreter(interpret):
    """The CUDA per-token quantization kernel's two passes over K (tails, zero rows) run by Triton's
    interpreter on the CPU, writing fp32: scales and scaled values bit-for-bit torch's (the e4m3 cast
    itself is checked on the GPU; the interpreter's fp8 rounding is not the hardware's)."""
    assert interpret(SCRIPT) == [[True, True]] * 4


GEMV_SCRIPT = r"""
import json, torch
from higgs_stream.kernels import fp8_linear as f, int8_linear as i8
kernel, errs = i8.build_kernel(), []
for m, n, k in [(1, 40, 300), (5, 64, 128), (16, 33, 529)]:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * 3
    qw, ws = f.quantize_rows_ref(torch.randn(n, k, generator=g) * 0.02)
    out = torch.full((m, n), float("nan"))
    i8.launch(kernel, x, qw.float(), ws, out, blocks=f.gemv_blocks(k))  # e4m3 values held in fp32: same products
    want = f.fp8_linear_ref(x, qw, ws)  # m <= GEMV_MAX_M: weight-only
    errs.append(((out - want).abs().max() / ((x.abs() @ qw.float().abs().t()) * ws).max()).item())
print(json.dumps(errs))
"""


def test_fp8_small_batch_kernel_in_the_interpreter(interpret):
    """fp8's small-batch multiply (the int8 kernel at fp8's blocks, weight-only) run by Triton's
    interpreter on the CPU with the e4m3 values held in fp32: the definition's product and scale to
    fp32 summation order, every output written (M, N and K tails)."""
    errs = interpret(GEMV_SCRIPT)
    assert len(errs) == 3 and max(errs) < 1e-6, errs


@pytest.mark.parametrize("q_type, x_type", [("*fp8e4nv", "*bf16"), ("*i8", "*bf16")])
def test_the_small_batch_kernel_compiles_for_hopper(q_type, x_type, compile_for_hopper):
    """No GPU needed: both specializations the engine launches at M <= 16 (e4m3 at fp8's blocks, int8 at
    its own; each widened to bf16) lower to PTX and assemble for sm_90 with Triton's bundled ptxas, with
    16-byte asynchronous weight loads (a byte-wise weight load would bound the GEMV)."""
    from higgs_stream.kernels import int8_linear
    from higgs_stream.kernels.fp8_linear import gemv_blocks

    sig = {"x_ptr": x_type, "q_ptr": q_type, "s_ptr": "*fp32", "xs_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32",
           "N": "i32", **dict.fromkeys(("K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "IEEE", "W_FLOAT", "X_SCALED", "ACC_EVERY"), "constexpr")}
    fp8 = q_type == "*fp8e4nv"
    bm, bn, bk, warps, stages = gemv_blocks(3072) if fp8 else int8_linear.block_sizes(1)
    consts = {"K": 3072, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "IEEE": False, "W_FLOAT": fp8, "X_SCALED": False,
              "ACC_EVERY": 0}
    compiled = compile_for_hopper(int8_linear.build_kernel(), sig, consts, num_warps=warps, num_stages=stages)
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and "cp.async.cg.shared.global" in ptx and "ld.global.b8" not in ptx


SCALED_SCRIPT = r"""
import json, torch
from higgs_stream.kernels import fp8_linear as f, int8_linear as i8
kernel, errs = i8.build_kernel(), []
for m, n, k, blocks in [(3, 40, 300, None), (70, 64, 128, (64, 32, 64, 4, 1)), (130, 33, 529, (128, 64, 128, 4, 1))]:
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g) * 3
    qw, ws = f.quantize_rows_ref(torch.randn(n, k, generator=g) * 0.02)
    xq, xs = f.quantize_per_token_ref(x)
    out = torch.full((m, n), float("nan"))
    i8.launch(kernel, xq.float(), qw.float(), ws, out, blocks=blocks, x_scale=xs)  # e4m3 values held in fp32
    want = f.fp8_linear_ref(x, qw, ws, gemv_max_m=0)  # per-token activations, as the scaled GEMM
    errs.append(((out - want).abs().max() / ((xq.float().abs() @ qw.float().abs().t()) * xs[:, None] * ws).max()).item())
print(json.dumps(errs))
"""


def test_the_scaled_kernel_in_the_interpreter(interpret):
    """The kernel's w8a8 form (e4m3 activations with per-row scales over e4m3 weights, `triton_scaled_linear`) run
    by Triton's interpreter with the e4m3 values held in fp32: the definition's per-token product to fp32 summation
    order, every row scaled by its own scale, M / N / K tails written."""
    errs = interpret(SCALED_SCRIPT)
    assert len(errs) == 3 and max(errs) < 1e-6, errs


def test_the_scaled_kernel_compiles_to_fp8_tensor_cores(compile_for_hopper):
    """No GPU needed: e4m3 x e4m3 lowers to Hopper's fp8 warpgroup MMA (no widening of either operand), with or
    without promoting its partial sums into fp32 along K."""
    from higgs_stream.kernels import int8_linear

    sig = {"x_ptr": "*fp8e4nv", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "xs_ptr": "*fp32", "out_ptr": "*bf16",
           "M": "i32", "N": "i32",
           **dict.fromkeys(("K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "IEEE", "W_FLOAT", "X_SCALED", "ACC_EVERY"),
                           "constexpr")}
    for every in (0, 32):  # the MMA's own sums over K, or promoted into fp32 every 32 of K
        consts = {"K": 3072, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "IEEE": False, "W_FLOAT": True,
                  "X_SCALED": True, "ACC_EVERY": every}
        compiled = compile_for_hopper(int8_linear.build_kernel(), sig, consts, num_warps=4, num_stages=3)
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"] and "wgmma" in ptx and "e4m3.e4m3" in ptx
