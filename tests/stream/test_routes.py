"""The framework-independent routes (stream/routes.py) on stand-ins, without a server: what `/healthz` says of the
engine's linears. The routes on a live server, on both transports: test_server.py."""

from __future__ import annotations


def test_healthz_says_which_linears_run_on_the_gemv():
    """`/healthz`'s `linears`: per FastTalker the rows the CUDA-core GEMV serves and the weight shapes it took
    (engine/gemv_choice.py; what a GPU server's ModelRunner reports), {} for an engine without a fast path."""
    from types import SimpleNamespace

    from higgs_stream.engine.gemv_choice import NONE, GemvChoice
    from higgs_stream.stream.routes import linear_choices

    chosen = GemvChoice(frozenset({(1024, 2048), (512, 256)}), 4)
    runner = SimpleNamespace(gemv_choices=lambda: {"talker": NONE, "code_predictor": chosen})
    assert linear_choices(SimpleNamespace(runner=runner)) == {
        "talker": {"bf16_gemv_rows": 0, "gemv_shapes": []},
        "code_predictor": {"bf16_gemv_rows": 4, "gemv_shapes": [[512, 256], [1024, 2048]]}}
    assert linear_choices(SimpleNamespace()) == {}  # a stand-in engine without a runner
