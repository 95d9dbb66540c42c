"""The code predictor's frame attention (fast_predictor.FrameAttention over a FrameLayout): the page layout of
every sub-step, and the attention over it equal to attention over K/V copied out per query head, for the first
sub-step (2 causal rows a stream) and later ones (1 row over the filled prefix): the plain-torch definition
(kernels="ref") and the Triton kernel under Triton's interpreter (fp32); the launch at the 1.7B predictor's heads
compiles for sm_90. GPU twin (bf16, those heads): test_fast_predictor_gpu.py."""

from __future__ import annotations

import pytest
import torch

from higgs_stream.engine.models.qwen3_tts.fast_predictor import FrameAttention, FrameLayout


def test_the_layout_of_each_sub_step():
    layout = FrameLayout(3, 16, "cpu")
    indptr, pages, lens = layout.csr(1)  # rows (2 s, 2 s + 1): stream s at positions 0 and 1
    assert indptr.tolist() == list(range(7)) and pages.tolist() == [0, 0, 1, 1, 2, 2]
    assert lens.tolist() == [1, 2, 1, 2, 1, 2]
    indptr, pages, lens = layout.csr(9)  # one row a stream at position 9: ten positions filled
    assert indptr.tolist() == [0, 1, 2, 3] and pages.tolist() == [0, 1, 2] and lens.tolist() == [10, 10, 10]
    assert all(t.dtype == torch.int32 for g in (1, 15) for t in layout.csr(g))
    assert layout.csr(15)[2].tolist() == [16, 16, 16]


@pytest.mark.parametrize("streams", [1, 2, 5])
def test_the_layout_tensors_are_contiguous_at_any_stream_count(streams):
    """The kernel reads them by element offsets: at one stream an expanded page list would be a stride-0 view of one
    element, and the second row's page id would be read past it (an illegal address on the GPU, session 24)."""
    layout = FrameLayout(streams, 16, "cpu")
    for g in (1, 2, 15):
        for t in layout.csr(g):
            assert t.is_contiguous() and t.untyped_storage().nbytes() >= t.numel() * 4
    assert layout.csr(1)[1].tolist() == [s for s in range(streams) for _ in range(2)]
    assert layout.csr(1)[2].tolist() == [1, 2] * streams


def frame_case(g: int, hq: int, hkv: int, b: int = 3, d: int = 16, seed: int = 0):
    """Sub-step g's queries [B t, Hq, D] and a random frame buffer [B, 16, Hkv, D] (t = 2 at g = 1, else 1)."""
    gen = torch.Generator().manual_seed(seed + g)
    t = 2 if g == 1 else 1
    q = torch.randn(b * t, hq, d, generator=gen)
    k_cache, v_cache = (torch.randn(b, 16, hkv, d, generator=gen) for _ in range(2))
    return q, k_cache, v_cache, t


@pytest.mark.parametrize("g", [1, 8, 15])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4)])
def test_reference_kernels_equal_copied_heads(g, hq, hkv, copied_heads):
    q, k_cache, v_cache, t = frame_case(g, hq, hkv)
    got = FrameAttention(FrameLayout(3, 16, "cpu").csr(g), 16, fast=False).run(q, k_cache, v_cache)
    want = copied_heads(q, k_cache, v_cache, t, g + 1, hq, hkv, 16)
    assert got.shape == (3 * t, hq, 16)
    assert (got - want).abs().max().item() <= 1e-5  # fp32 rounding of O(1) values


SCRIPT = r"""
import json, torch
from higgs_stream.kernels import paged_decode as pd
from higgs_stream.engine.models.qwen3_tts.fast_predictor import FrameAttention, FrameLayout
out = []
for b, g in ((3, 1), (3, 2), (3, 15), (1, 1), (1, 15)):
    gen = torch.Generator().manual_seed(g)
    t = 2 if g == 1 else 1
    q = torch.randn(b * t, 4, 16, generator=gen)
    k, v = (torch.randn(b, 16, 2, 16, generator=gen) for _ in range(2))
    csr = FrameLayout(b, 16, "cpu").csr(g)
    got = pd.launch(q, k, v, *csr, 16 ** -0.5, block_n=FrameAttention.BLOCK_N)  # the fast path's launch
    want = pd.paged_decode_ref(q, k, v, *csr, 16 ** -0.5)
    out.append([(got - want).abs().max().item(), want.abs().max().item()])
print(json.dumps(out))
"""


def test_the_kernel_over_the_layout_in_the_interpreter(interpret):
    for err, peak in interpret(SCRIPT):
        assert err < 1e-5 * max(peak, 1.0) and peak > 0.3, (err, peak)  # fp32 rounding of O(1) outputs


def test_the_launch_compiles_for_hopper_at_the_predictors_heads(compile_for_hopper):
    """The 1.7B code predictor's heads (16 query heads over 8 K/V heads, head_dim 128) over bf16 frame pages of 16
    slots, one 16-token block: the scores and P @ V on tensor cores (the group of 2 padded to 16 rows)."""
    from higgs_stream.kernels import paged_decode as pd

    consts = {"HKV": 8, "GROUP": 2, "GROUP_PAD": 16, "D": 128, "PAGE": 16, "BLOCK_N": FrameAttention.BLOCK_N,
              "PROGRAMS": 1, "RANGE": 0, "SLOTS": 1, "FP8_WORDS": False}
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "part_ptr": "*bf16",
           "ml_ptr": "*bf16", "indptr_ptr": "*i32", "indices_ptr": "*i32", "last_ptr": "*i32", "scale_log2": "fp32",
           **dict.fromkeys((*consts, "PDL"), "constexpr")}
    compiled = compile_for_hopper(pd._kernel(), sig, {**consts, "PDL": False}, num_warps=pd.TRITON_DECODE_PARAMS[1],
                                  num_stages=pd.TRITON_DECODE_PARAMS[2])
    assert "mma" in compiled.asm["ptx"]
