"""The fused draw (kernels/sample_rows.py): its plain-torch reference on the CPU, and the Triton kernel
run by Triton's interpreter on the CPU against that reference (the compiled kernel on CUDA:
test_sample_rows_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

from higgs_stream.kernels.sample_rows import sample_rows_ref

INF = float("inf")

def test_the_reference_draws_the_warped_distribution():
    b, v = 4, 50
    logits = torch.randn(b, 1, v, generator=torch.Generator().manual_seed(0))
    logits[1, 0, 3] = float("nan")
    noise = torch.ones(b, 1, v)  # equal noise: the race picks the most probable id
    p = {"temperature": torch.ones(b), "top_k": torch.full((b,), v), "top_p_cut": torch.full((b,), -1.0),
         "greedy": torch.tensor([False, False, True, False])}
    tokens, finite = sample_rows_ref(logits, noise, **p)
    assert finite[:, 0].tolist() == [True, False, True, True]
    assert tokens[1, 0] == 0  # a row with a NaN is drawn from zeros: all ids tie, the first wins
    assert tokens[[0, 2, 3], 0].tolist() == logits[[0, 2, 3], 0].argmax(-1).tolist()
    # top-k 1 leaves only the argmax whatever the noise; processed rows (-inf suppressions) are not "cleaned"
    wild = torch.empty(b, 1, v).exponential_(generator=torch.Generator().manual_seed(1))
    logits[:, 0, 0] = -INF
    tokens, finite = sample_rows_ref(logits.nan_to_num(0.0), wild, **{**p, "top_k": torch.ones(b, dtype=torch.long)},
                                     clean=False)
    assert finite is None and tokens[:, 0].tolist() == logits.nan_to_num(0.0)[:, 0].argmax(-1).tolist()


SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from conftest import ambiguous, params
from higgs_stream.kernels import sample_rows as sr
out = []
for b, h, v, seed in ((16, 2, 200, 0), (12, 1, 100, 1)):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, h, v, generator=g) * 3
    noise = torch.empty(b, h, v).exponential_(generator=g)
    p = params(b, v, seed)
    logits[5, 0, 7], logits[6, h - 1, 0] = float("nan"), float("inf")
    tokens, finite = sr._launch(logits, noise, clean=True, **p)
    want, want_finite = sr.sample_rows_ref(logits, noise, clean=True, **p)
    clean = torch.where(want_finite[..., None], logits, 0.0)
    clean[:, :, 1::9] = -float("inf")  # suppressed ids, as a family's logits processors leave them
    tokens2, none = sr._launch(clean, noise, clean=False, **p)
    want2, _ = sr.sample_rows_ref(clean, noise, clean=False, **p)
    skip = ambiguous(clean, noise, p) | ambiguous(torch.where(want_finite[..., None], logits, 0.0), noise, p)
    out.append({"finite_equal": bool(torch.equal(finite, want_finite)), "not_finite": int((~finite).sum()),
                "compared": int((~skip).sum()), "rows": b * h, "none": none is None,
                "differ": int(((tokens != want) & ~skip).sum()), "differ_clean": int(((tokens2 != want2) & ~skip).sum()),
                "suppressed_drawn": int((tokens2 % 9 == 1).sum())})
print(json.dumps(out))
"""


def test_the_kernel_in_the_interpreter_draws_what_the_reference_draws(interpret):
    """Every row the reference does not leave to rounding (see `ambiguous`) gets the reference's token,
    with and without cleaning; non-finite rows are reported as the reference reports them."""
    for case in interpret(SCRIPT, os.path.dirname(__file__), timeout=600):
        assert case["finite_equal"] and case["not_finite"] == 2 and case["none"], case
        assert case["compared"] >= 0.9 * (case["rows"] - case["not_finite"]), case
        assert case["differ"] == 0 and case["differ_clean"] == 0 and case["suppressed_drawn"] == 0, case


@pytest.mark.parametrize("block,clean,warps", [(2048, True, 4), (4096, False, 8)])
def test_the_kernel_compiles_for_hopper(block, clean, warps, compile_for_hopper):
    """No GPU needed: Triton lowers the kernel to PTX and its bundled ptxas assembles it for sm_90, at
    the block sizes the engine launches (vocabularies up to 2048 and up to 4096), with no local-memory
    traffic in the PTX (the row and its keys stay in registers)."""
    from higgs_stream.kernels import sample_rows

    _, kernel = sample_rows._kernel()
    sig = {"x_ptr": "*fp32", "noise_ptr": "*fp32", "temp_ptr": "*fp32", "topk_ptr": "*i64", "cut_ptr": "*fp32",
           "greedy_ptr": "*i8", "tok_ptr": "*i64", "finite_ptr": "*i8", "x_sb": "i32", "x_sh": "i32",
           "n_sb": "i32", "n_sh": "i32", "heads": "i32", "vocab": "i32", "BLOCK": "constexpr", "CLEAN": "constexpr"}
    compiled = compile_for_hopper(kernel, sig, {"BLOCK": block, "CLEAN": clean}, num_warps=warps)
    assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"]


def test_the_launch_refuses_per_row_values_that_are_not_contiguous():
    """The kernel reads each row's temperature, top-k, top-p cut and greedy flag at the row's element offset: an
    expanded (stride-0) or strided view is refused before any launch, not misread."""
    from higgs_stream.kernels import sample_rows as sr

    logits = torch.zeros(3, 1, 8)
    ok = dict(temperature=torch.ones(3), top_k=torch.zeros(3, dtype=torch.long), top_p_cut=torch.full((3,), -1.0),
              greedy=torch.zeros(3, dtype=torch.bool))
    bad = {"temperature": torch.ones(1).expand(3), "top_k": torch.zeros(6, dtype=torch.long)[::2]}
    for name, value in bad.items():
        with pytest.raises(AssertionError, match="contiguous"):
            sr._launch(logits, torch.ones_like(logits), **{**ok, name: value}, clean=True)
