"""The Triton RoPE + paged K/V store run by Triton's interpreter on the CPU (fp32 pools): equal to the
plain-torch reference, with the fp8 pages' saturation on clamped at +-448 (the e4m3 cast itself is
checked on the GPU, tests/kernels/test_rope_kv_gpu.py), and with Qwen3's QK-norm fused in equal to the
unfused norm then RoPE. It compiles for sm_90 with the norm (no GPU needed)."""

from __future__ import annotations


import pytest

SCRIPT = r"""
import json, torch
from higgs_stream.kernels import rope_kv
hq, hkv, d, n = 4, 2, 16, 5
g = torch.Generator().manual_seed(0)
qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g) * 300  # values past 448
pos, slots = torch.tensor([0, 3, 7, 8, 20]), torch.tensor([9, 2, 5, 30, 17])
cs = rope_kv.cos_sin_table(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 64, "cpu")
kernel, out = rope_kv._kernel(), []
w = torch.rand(2, d, generator=g) + 0.5  # QK-norm weights: q row, k row
for saturate, qk_norm in ((False, None), (True, None), (False, w)):
    pools, ref = [torch.zeros(8, 4, hkv, d) for _ in range(2)], [torch.zeros(8, 4, hkv, d) for _ in range(2)]
    q = torch.empty(n, hq, d)
    kernel[(n, hq + hkv)](qkv, pos, cs, slots, q, *pools, cs if qk_norm is None else qk_norm, 1e-6, HQ=hq, HKV=hkv,
                          D=d, KV_FP8=saturate, KV_MAX=448.0, QK_NORM=qk_norm is not None, num_warps=1)
    want_q = rope_kv.rope_store_kv_ref(qkv, pos, cs, slots, *ref, hq, hkv, d, qk_norm, 1e-6)
    ref = [r.clamp(-448, 448) for r in ref] if saturate else ref
    row = [(q - want_q).abs().max().item(), (pools[0] - ref[0]).abs().max().item(),
           (pools[1] - ref[1]).abs().max().item(), pools[1].abs().max().item()]
    if qk_norm is not None:  # the reference itself == the unfused path: norm each q/k head, then RoPE
        heads = qkv.view(n, hq + 2 * hkv, d).clone()
        x = heads[:, : hq + hkv]
        sel = (torch.arange(hq + hkv) >= hq).long()
        heads[:, : hq + hkv] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[sel]
        unfused = [torch.zeros(8, 4, hkv, d) for _ in range(2)]
        want_unfused = rope_kv.rope_store_kv_ref(heads.view(n, -1), pos, cs, slots, *unfused, hq, hkv, d)
        row += [(want_q - want_unfused).abs().max().item(), (ref[0] - unfused[0]).abs().max().item(),
                q.abs().max().item()]
    out.append(row)
print(json.dumps(out))
"""


def test_triton_store_in_the_interpreter(interpret):
    plain, saturated, normed = interpret(SCRIPT)
    assert max(plain[:3]) < 1e-4 and plain[3] > 448  # fp32 rounding of ~300-sized values; nothing clamped
    assert max(saturated[:3]) < 1e-4 and saturated[3] == 448.0
    # normed heads are O(1): fp32 rounding; the fused reference == norm-then-rope; and the norm happened
    assert max(normed[:3]) < 1e-5 and max(normed[4:6]) < 1e-5 and normed[6] < 10, normed


@pytest.mark.parametrize("pool", ["*bf16", "*fp8e4nv"])
def test_the_kernel_with_qk_norm_compiles_for_hopper(pool, compile_for_hopper):
    """bf16 qkv, bf16 or fp8 K/V pages, the QK-norm on (Qwen3 layers: Higgs v3, Qwen3-TTS), head_dim 128:
    lowers to PTX and assembles for sm_90 with Triton's bundled ptxas."""
    from higgs_stream.kernels import rope_kv

    sig = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64",
           "q_ptr": "*bf16", "k_ptr": pool, "v_ptr": pool, "w_ptr": "*bf16", "eps": "fp32",
           **dict.fromkeys(("HQ", "HKV", "D", "KV_FP8", "KV_MAX", "QK_NORM"), "constexpr")}
    consts = {"HQ": 16, "HKV": 8, "D": 128, "KV_FP8": pool == "*fp8e4nv", "KV_MAX": 448.0, "QK_NORM": True}
    compiled = compile_for_hopper(rope_kv._kernel(), sig, consts, num_warps=1)
    assert compiled.asm["cubin"]
