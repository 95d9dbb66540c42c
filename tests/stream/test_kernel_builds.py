"""Kernels built while serving (stream/kernel_builds.py): Triton's build hooks and dynamo's compile callbacks reach
`BuildWatch` with the kernel's name and seconds, chained to hooks installed before it and removed on close; the
pipeline counts what start-up built apart from what serving built (the metric, a warning, the trace). The real
Triton builds on a GPU: tests/stream/test_kernel_builds_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch
from higgs_stream.stream import kernel_builds
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.kernel_builds import BuildWatch
from higgs_stream.stream.pipeline import Pipeline

triton = pytest.importorskip("triton")
tl = triton.language
knobs = triton.knobs


@triton.jit
def _noop_kernel(x_ptr, BLOCK: tl.constexpr):
    pass


@pytest.fixture
def hooks(monkeypatch):
    """A process-wide hook set of the test's own, so no watch left open elsewhere in the process is in it; Triton's
    hook slots as they were afterwards."""
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    monkeypatch.setattr(kernel_builds, "_HOOKS", kernel_builds._Hooks())
    yield kernel_builds._HOOKS
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before


def _options():
    from triton.backends.nvidia.compiler import CUDAOptions

    return CUDAOptions()


def _triton_build(hook_slot: str, constants: dict) -> object:
    """Triton's own hook call for a build of `_noop_kernel` (its `_call_hook`, as `_do_compile` makes it)."""
    key = ("spec", ("*fp32", "constexpr"))
    signature = {"x_ptr": "*fp32", "BLOCK": "constexpr"}
    return _noop_kernel._call_hook(getattr(knobs.runtime, hook_slot), key, signature, 0, constants, _options(), [{}],
                                   False)


def test_a_triton_build_is_reported_with_its_constexprs_and_chains_the_hooks_before_it(hooks):
    earlier: list[str] = []
    knobs.runtime.jit_cache_hook = lambda **kw: earlier.append("cache") or None
    knobs.runtime.jit_post_compile_hook = lambda **kw: earlier.append("post")
    builds: list[tuple] = []
    watch = BuildWatch(lambda kind, name, start, seconds: builds.append((kind, name, start, seconds)))
    try:
        assert _triton_build("jit_cache_hook", {(1,): 64}) is None  # None: Triton goes on to build it
        _triton_build("jit_post_compile_hook", {(1,): 64})
    finally:
        watch.close()
    assert earlier == ["cache", "post"]
    [(kind, name, start, seconds)] = builds
    assert (kind, name) == ("triton", "_noop_kernel[BLOCK=64]") and start > 0 and seconds >= 0
    assert knobs.runtime.jit_cache_hook is not None and knobs.runtime.jit_cache_hook.__name__ == "<lambda>"
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    _triton_build("jit_cache_hook", {(1,): 64})  # closed: nothing reaches it
    assert len(builds) == 1


def test_an_earlier_hook_that_skips_the_build_is_obeyed(hooks):
    knobs.runtime.jit_cache_hook = lambda **kw: True  # True: Triton skips the build
    watch = BuildWatch(lambda *a: None)
    try:
        assert _triton_build("jit_cache_hook", {(1,): 16}) is True
    finally:
        watch.close()
        knobs.runtime.jit_cache_hook = None


def test_watches_share_one_set_of_hooks_whatever_order_they_close_in(hooks):
    """Two pipelines' watches (the tests run many in one process): closed in the order they opened, the hooks go with
    the last one and the slots hold what they held before; a closed watch hears nothing (it chained a dead
    pipeline's hook before: a probe)."""
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    a, b = [], []
    watch_a = BuildWatch(lambda *x: a.append(x))
    watch_b = BuildWatch(lambda *x: b.append(x))
    _triton_build("jit_cache_hook", {(1,): 32})
    _triton_build("jit_post_compile_hook", {(1,): 32})
    assert len(a) == len(b) == 1
    watch_a.close()
    watch_a.close()  # twice: nothing more
    _triton_build("jit_cache_hook", {(1,): 32})
    _triton_build("jit_post_compile_hook", {(1,): 32})
    assert (len(a), len(b)) == (1, 2)
    watch_b.close()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None


def test_each_dynamo_compile_is_reported_once_while_installed(hooks):
    builds: list[tuple] = []
    watch = BuildWatch(lambda kind, name, start, seconds: builds.append((kind, name, seconds)))
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    try:
        fn(torch.ones(3))
        fn(torch.ones(3))  # the same guards: no compile
        assert [k for k, _, _ in builds] == ["dynamo"] and builds[0][2] > 0
        fn(torch.ones(5))  # another shape: a recompile
        assert len(builds) == 2 and builds[0][1] != builds[1][1]  # compile ids
    finally:
        watch.close()
    fn(torch.ones(7))
    assert len(builds) == 2


async def test_the_pipeline_counts_builds_while_serving_apart_from_start_up(caplog):
    from higgs_stream.bench_pipeline import FakeCodec, FakeEngine

    p = Pipeline(FakeEngine(step_s=0.001), FakeCodec(), ServerConfig())
    assert 'higgs_kernel_builds_total{kind="triton"} 0' in p.metrics.render()  # at 0 before the first build
    p.trace = []
    await p.start()
    fn = torch.compile(lambda x: x - 3, backend="eager", dynamic=False)
    try:
        fn(torch.ones(2))  # start-up's (warm-up): counted apart, no warning
        assert p.watch.start_builds[0] == 1 and p.metrics.kernel_builds.value(kind="dynamo") == 0
        p.mark_serving()
        with caplog.at_level(logging.WARNING, logger="higgs_stream.stream.serving_watch"):
            fn(torch.ones(4))
    finally:
        await p.stop()
    assert p.metrics.kernel_builds.value(kind="dynamo") == 1 and p.metrics.kernel_build_seconds.value(kind="dynamo") > 0
    assert 'higgs_kernel_builds_total{kind="dynamo"} 1' in p.metrics.render()
    assert any("built while serving" in r.getMessage() for r in caplog.records)
    [build] = [e for e in p.trace if e[0] == "build"]
    assert build[3] == "dynamo" and build[2] > build[1]
    fn(torch.ones(6))  # stopped: the watch is gone
    assert p.metrics.kernel_builds.value(kind="dynamo") == 1
