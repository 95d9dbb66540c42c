"""engine/gemv_choice.py on the CPU: which (shape, rows) the timings give to the GEMV, and the dispatch of a chosen
linear (the GEMV itself stood in for by a recorder; it runs in tests/kernels/test_int8_linear.py's interpreter and
on the GPU in tests/engine/test_gemv_choice_gpu.py)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from higgs_stream.engine import gemv_choice as gc
from higgs_stream.engine.quantize import quantize_weight
from higgs_stream.kernels.int8_linear import plain_gemv_blocks


def test_the_gemv_serves_the_shapes_whose_summed_time_was_at_most_the_margin_of_cublas():
    times = {(1024, 2048): [(12.9, 5.6), (12.9, 4.3), (8.5, 7.3), (8.5, 5.3)],  # 22.5 / 42.8 = 0.53: the GEMV
             (4096, 1024): [(5.4, 5.0), (5.4, 5.4), (5.3, 7.1), (5.3, 7.1)],  # 24.6 / 21.4: cuBLAS
             (2048, 2048): [(6.0, 5.1), (6.0, 5.1), (6.0, 5.1), (6.0, 5.1)],  # 0.85 exactly: the GEMV
             (6144, 1024): [(6.2, 5.3), (6.1, 5.2), (6.1, 5.2), (6.1, 5.2)]}  # 0.853: a near-tie keeps cuBLAS
    calls = []

    def timer(shape, m, way):
        calls.append((shape, m, way))
        return times[shape][m - 1][way == "gemv"]

    choice = gc.choose(list(times), 4, timer)
    assert choice.shapes == {(1024, 2048), (2048, 2048)} and choice.max_rows == 4
    assert len(calls) == 32 and len(choice.timings) == 16
    assert choice.timings[0] == {"n": 1024, "k": 2048, "m": 1, "cublas_us": 12.9, "gemv_us": 5.6}
    assert choice.describe() == {"bf16_gemv_rows": 4, "gemv_shapes": [[1024, 2048], [2048, 2048]]}
    assert choice.report()[0] == ("plain linear [1024, 2048] on the CUDA-core GEMV at 1-4 rows "
                                  "(us, cuBLAS -> GEMV: 12.9 -> 5.6, 12.9 -> 4.3, 8.5 -> 7.3, 8.5 -> 5.3)")
    assert len(choice.report()) == 2 and gc.NONE.report() == []
    w = torch.zeros(1024, 2048, dtype=torch.bfloat16)
    assert [choice.serves(w, m) for m in range(6)] == [False, True, True, True, True, False]  # every count 1..4
    assert not choice.serves(torch.zeros(4096, 1024, dtype=torch.bfloat16), 1)
    two = gc.choose([(1024, 2048)], 2, timer)  # 1-2 rows: 9.9 / 25.8
    assert two.shapes == {(1024, 2048)} and not two.serves(w, 3) and len(two.timings) == 2
    assert gc.choose([(8, 8)], 0, timer).shapes == frozenset()  # rows 0: nothing timed
    with pytest.raises(AssertionError, match="max_rows"):
        gc.choose([(8, 8)], 5, timer)


def test_a_shape_whose_timing_fails_stays_on_cublas(caplog):
    """Out of memory for the weight's copies, or a GEMV that does not compile here: that shape keeps cuBLAS, the
    others are still chosen, and the start-up goes on."""
    def timer(shape, m, way):
        if shape == (64, 64) and way == "gemv":
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return 10.0 if way == "cublas" else 4.0

    with caplog.at_level("WARNING", logger="higgs_stream.engine.gemv_choice"):
        choice = gc.choose([(64, 64), (32, 64)], 2, timer)
    assert choice.shapes == {(32, 64)}
    assert choice.timings[0]["error"].startswith("OutOfMemoryError") and len(choice.timings) == 3
    assert "cuBLAS serves it" in caplog.text


def test_plain_shapes_are_the_distinct_bf16_matrices():
    w = [torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(8, 16, dtype=torch.bfloat16),
         torch.zeros(4, 16, dtype=torch.float16), torch.zeros(4, 8),  # fp32: cuBLAS's own (never timed)
         torch.zeros(8, dtype=torch.bfloat16), quantize_weight(torch.randn(6, 16), "int8")]
    assert gc.plain_shapes(w) == [(8, 16), (4, 16)]
    assert gc.measure(w[3:], 4, torch.bfloat16, torch.device("cpu")) is gc.NONE  # no plain matrix: nothing to time
    assert gc.measure(w, 0, torch.bfloat16, torch.device("cpu")) is gc.NONE


def test_a_chosen_shape_and_row_count_runs_the_gemv_with_its_bias(monkeypatch):
    launched = []

    def gemv(x2, w, scale, blocks, bias):  # records, and computes what the kernel does
        launched.append((tuple(x2.shape), scale, blocks, bias is not None, x2.is_contiguous()))
        return F.linear(x2.float(), w.float(), None if bias is None else bias.float()).to(x2.dtype)

    monkeypatch.setattr(gc, "triton_gemv", gemv)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 2048, generator=g).bfloat16()
    b = torch.randn(8, generator=g).bfloat16()
    choice = gc.GemvChoice(frozenset({(8, 2048)}), 2)
    x = torch.randn(1, 2, 2048, generator=g).bfloat16()  # 2 rows in all: the GEMV, shaped back to [1, 2, 8]
    y = choice.linear(x, w, b)
    assert y.shape == (1, 2, 8) and launched == [((2, 2048), None, plain_gemv_blocks(2048), True, True)]
    # the recorder's own product (the same fp32 ops on the same [2, K] rows), shaped back: no other kernel's sums
    want = F.linear(x.reshape(2, 2048).float(), w.float(), b.float()).to(torch.bfloat16).view(1, 2, 8)
    assert torch.equal(y, want)
    x3 = torch.randn(3, 2048, generator=g).bfloat16()  # 3 rows: not chosen -> F.linear
    assert torch.equal(choice.linear(x3, w), F.linear(x3, w)) and len(launched) == 1
    strided = torch.randn(2048, 1, generator=g).bfloat16().t()  # one row, a transposed view: made contiguous
    choice.linear(strided, w)
    assert launched[-1][0] == (1, 2048) and launched[-1][4]
    assert torch.equal(choice.linear(x.float(), w.float()), F.linear(x.float(), w.float()))  # fp32: cuBLAS
    wt = torch.randn(2048, 8, generator=g).bfloat16().t()  # the chosen shape as a transposed view: cuBLAS
    assert torch.equal(choice.linear(x, wt), F.linear(x, wt)) and len(launched) == 2
    assert gc.NONE.shapes == frozenset() and not gc.NONE.serves(w, 1)


def test_fast_talker_times_nothing_on_the_reference_kernels():
    from higgs_stream.engine.fast_talker import FastTalker
    from higgs_stream.engine.models.higgs_v2.config import TalkerConfig
    from higgs_stream.engine.models.higgs_v2.talker import Talker

    fast = FastTalker(Talker(TalkerConfig.tiny()).eval(), "ref", bf16_gemv_rows=4)
    assert fast.bf16_gemv_rows == 0 and fast.gemv is gc.NONE


def test_compile_ahead_asks_for_every_variant_the_timing_launches():
    asked = []
    gc.compile_ahead([(1024, 2048), (512, 512)], 3, torch.bfloat16, lambda cases, dtype: asked.append((cases, dtype)))
    assert asked == [([(1, 1024, 2048), (2, 1024, 2048), (3, 1024, 2048), (1, 512, 512), (2, 512, 512),
                       (3, 512, 512)], torch.bfloat16)]


def test_a_failed_compile_ahead_is_logged_and_start_up_goes_on(caplog):
    def fails(cases, dtype):
        raise RuntimeError("ptxas died")

    with caplog.at_level(logging.WARNING, logger="higgs_stream.engine.gemv_choice"):
        gc.compile_ahead([(1024, 2048)], 2, torch.bfloat16, fails)  # returns: no exception
    assert "compiling the CUDA-core GEMV ahead failed" in caplog.text and "ptxas died" in caplog.text
