"""The Triton RoPE + paged K/V store run by Triton's interpreter on the CPU (fp32 pools): equal to the
plain-torch reference, and with the fp8 pages' saturation on, clamped at +-448 (the e4m3 cast itself
is checked on the GPU, tests/kernels/test_rope_kv_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
for saturate in (False, True):
    pools, ref = [torch.zeros(8, 4, hkv, d) for _ in range(2)], [torch.zeros(8, 4, hkv, d) for _ in range(2)]
    q = torch.empty(n, hq, d)
    kernel[(n, hq + hkv)](qkv, pos, cs, slots, q, *pools, HQ=hq, HKV=hkv, D=d, KV_FP8=saturate, KV_MAX=448.0,
                          num_warps=1)
    want_q = rope_kv.rope_store_kv_ref(qkv, pos, cs, slots, *ref, hq, hkv, d)
    ref = [r.clamp(-448, 448) for r in ref] if saturate else ref
    out.append([(q - want_q).abs().max().item(), (pools[0] - ref[0]).abs().max().item(),
                (pools[1] - ref[1]).abs().max().item(), pools[1].abs().max().item()])
print(json.dumps(out))
"""


def test_triton_store_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    plain, saturated = json.loads(run.stdout.strip().splitlines()[-1])
    assert max(plain[:3]) < 1e-4 and plain[3] > 448  # fp32 rounding of ~300-sized values; nothing clamped
    assert max(saturated[:3]) < 1e-4 and saturated[3] == 448.0
