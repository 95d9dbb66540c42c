"""The fused producers of per-token fp8 activations (`fp8_linear.Fp8Rows`): the add + RMSNorm kernel with its
QUANT path (kernels/fused_norm.py) and the SiLU-and-multiply quantizing kernel (kernels/activation.py), each run by
Triton's interpreter on the CPU, writing the scaled values in fp32 (the interpreter's e4m3 cast is not the
hardware's; the GPU twin compares the e4m3 bytes): equal, bit for bit, to the unfused pair (the plain kernel to bf16,
then `quantize_per_token`'s kernel) run the same way, and both compile for sm_90."""

from __future__ import annotations

import pytest

SCRIPT = r"""
import json, torch
from higgs_stream.kernels import activation, fp8_linear as f, fused_norm
g = torch.Generator().manual_seed(0)
out = []
norm = fused_norm._kernel()
for n, h, sel in ((3, 100, False), (5, 64, True)):  # row tails; stacked weights chosen per row
    res = torch.randn(n, h, generator=g) * 4
    delta = torch.randn(n, h, generator=g).bfloat16()
    w = torch.rand(2 if sel else 1, h, generator=g) + 0.5
    select = torch.tensor([i % 2 for i in range(n)], dtype=torch.int32) if sel else None
    r1, r2 = res.clone(), res.clone()
    plain = torch.empty(n, h, dtype=torch.bfloat16)
    fused_norm.launch(norm, delta, r1, w, 1e-6, select, plain, None)
    q_ref, s_ref = torch.empty(n, h), torch.empty(n)
    f._kernel()[(n,)](plain, q_ref, s_ref, h, f.EPS, f.INV_FP8_MAX, f.FP8_MAX, BLOCK=1024)
    q, s = torch.full((n, h), float("nan")), torch.empty(n)
    fused_norm.launch(norm, delta, r2, w, 1e-6, select, q, s)
    out.append([torch.equal(q, q_ref), torch.equal(s, s_ref), torch.equal(r1, r2), q.abs().max().item()])
act = activation._quant_kernel()
for n, inter in ((2, 1500), (4, 64)):  # rows padded to a power of two (2,048) and one exactly a power of two
    gu = (torch.randn(n, 2 * inter, generator=g) * 3).bfloat16()
    plain = torch.empty(n, inter, dtype=torch.bfloat16)
    activation._kernel()[1][(n, -(-inter // 1024))](gu, plain, inter, BLOCK=1024)
    q_ref, s_ref = torch.empty(n, inter), torch.empty(n)
    f._kernel()[(n,)](plain, q_ref, s_ref, inter, f.EPS, f.INV_FP8_MAX, f.FP8_MAX, BLOCK=1024)
    q, s = torch.full((n, inter), float("nan")), torch.empty(n)
    activation.launch_fp8(act, gu, q, s)
    out.append([torch.equal(q, q_ref), torch.equal(s, s_ref), True, q.abs().max().item()])
print(json.dumps(out))
"""


def test_fused_quantization_equals_the_unfused_pair_in_the_interpreter(interpret):
    for same_q, same_scale, same_residual, peak in interpret(SCRIPT):
        assert same_q and same_scale and same_residual, (same_q, same_scale, same_residual)
        assert abs(peak - 448.0) < 1e-3  # each row's largest value lands on the e4m3 maximum


def test_the_fused_kernels_compile_for_hopper(compile_for_hopper):
    """bf16 in, e4m3 out, as the engine launches them (v2's widths: 3,072 for the norm, 8,192 for SiLU)."""
    from higgs_stream.kernels import activation, fused_norm

    sig = {"delta_ptr": "*bf16", "res_ptr": "*fp32", "w_ptr": "*bf16", "sel_ptr": "*fp32", "out_ptr": "*fp8e4nv",
           "scale_ptr": "*fp32", "H": "i32", "eps": "fp32", "q_eps": "fp32", "inv_fp8_max": "fp32", "fp8_max": "fp32",
           **dict.fromkeys(("HAS_DELTA", "HAS_SELECT", "QUANT", "BLOCK"), "constexpr")}
    consts = {"HAS_DELTA": True, "HAS_SELECT": False, "QUANT": True, "BLOCK": 4096}
    assert compile_for_hopper(fused_norm._kernel()[1], sig, consts, num_warps=8).asm["cubin"]
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "inter": "i32", "q_eps": "fp32",
           "inv_fp8_max": "fp32", "fp8_max": "fp32", "BLOCK": "constexpr"}
    ptx = compile_for_hopper(activation._quant_kernel(), sig, {"BLOCK": 8192}, num_warps=8).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # the e4m3 cast: the hardware's instruction, saturating


def test_fp8_linear_takes_prequantized_rows():
    """`fp8_linear` given `Fp8Rows` multiplies them without quantizing again: what it computes from the bf16 rows
    (their per-token quantization, then the product), here through its fp32 path for a weight the scaled GEMM cannot
    take (33 output rows: not a multiple of 16), which runs on the CPU; refused at the weight-only GEMV's row counts
    (<= 16), where no activation is quantized."""
    import torch

    from higgs_stream.kernels.fp8_linear import FP8, GEMV_MAX_M, Fp8Rows, fp8_linear, fp8_linear_ref, quantize_rows_ref

    g = torch.Generator().manual_seed(3)
    q, w_scale = quantize_rows_ref(torch.randn(33, 64, generator=g) * 0.05)
    x = (torch.randn(40, 64, generator=g) * 2).bfloat16()
    got = fp8_linear(Fp8Rows(*quantize_rows_ref(x)), q, w_scale)
    want = fp8_linear_ref(x, q, w_scale)  # 40 rows > GEMV_MAX_M: the same per-token quantization
    assert got.dtype == torch.bfloat16 and got.shape == (40, 33)
    assert torch.equal(got, want)  # the same fp32 products and scales, one rounding to bf16
    few = Fp8Rows(torch.zeros(GEMV_MAX_M, 64, dtype=FP8), torch.ones(GEMV_MAX_M))
    with pytest.raises(AssertionError, match="scaled GEMM"):
        fp8_linear(few, q, w_scale)
