"""Kernels built while serving: the first-use costs a live request pays.

A Triton kernel is built once per process for each specialization it is launched with (its constexprs, which
integer arguments are 1 or divisible by 16, the dtypes): compiled, or loaded from Triton's on-disk cache, which is
faster but still milliseconds to tens of them. A `torch.compile`d function compiles again for a shape or mode its
guards have not seen (through inductor, whose FX-graph cache plays the disk cache's part). Start-up's warm-up is meant
to build every kernel serving needs; one that serving builds instead stalls the thread that launched it, the engine
loop or the codec, and with it every stream in flight. On a fresh machine (empty caches, as after a deploy) such a
build costs the most.

`BuildWatch` calls `on_build(kind, name, start, seconds)` after every such build (monotonic seconds; kind "triton"
or "dynamo"), from whichever thread built it. It chains to hooks installed before it (Triton keeps one hook a slot)
and restores them on `close()`. Builds inside Triton's asynchronous compile mode (which the engine does not use) are
not timed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

OnBuild = Callable[[str, str, float, float], None]


class BuildWatch:
    """Calls `on_build` after every Triton specialization and dynamo compilation this process builds while
    installed. Install once per process (`close()` removes it)."""

    def __init__(self, on_build: OnBuild) -> None:
        self._on_build = on_build
        self._local = threading.local()  # this thread's builds in progress: (kind, name) -> start
        self._knobs = _triton_knobs()
        self._dynamo = _dynamo_callbacks()
        if self._knobs is not None:
            self._prev_cache_hook = self._knobs.jit_cache_hook
            self._prev_post_hook = self._knobs.jit_post_compile_hook
            self._knobs.jit_cache_hook = self._triton_start
            self._knobs.jit_post_compile_hook = self._triton_end
        if self._dynamo is not None:
            self._dynamo.register_start_callback(self._dynamo_start)
            self._dynamo.register_end_callback(self._dynamo_end)

    def _starts(self) -> dict:
        starts = getattr(self._local, "starts", None)
        if starts is None:
            starts = self._local.starts = {}
        return starts

    def _triton_start(self, *args, **kwargs):
        """Triton's in-memory cache missed (it returns None: build it, or True: skip the build, as a chained hook
        may say)."""
        self._starts()["triton", _triton_name(kwargs)] = time.monotonic()
        return self._prev_cache_hook(*args, **kwargs) if self._prev_cache_hook else None

    def _triton_end(self, *args, **kwargs):
        self._finish("triton", _triton_name(kwargs))
        return self._prev_post_hook(*args, **kwargs) if self._prev_post_hook else None

    def _dynamo_start(self, args) -> None:
        self._starts()["dynamo", str(getattr(args, "compile_id", "?"))] = time.monotonic()

    def _dynamo_end(self, args) -> None:
        self._finish("dynamo", str(getattr(args, "compile_id", "?")))

    def _finish(self, kind: str, name: str) -> None:
        start = self._starts().pop((kind, name), None)
        if start is None:  # began before the watch was installed, or in another thread (async compile)
            return
        try:
            self._on_build(kind, name, start, time.monotonic() - start)
        except Exception:  # a hook runs inside Triton's or dynamo's build: never fail the kernel for a metric
            log.exception("kernel build callback failed")

    def close(self) -> None:
        if self._knobs is not None and self._knobs.jit_cache_hook == self._triton_start:
            self._knobs.jit_cache_hook = self._prev_cache_hook
            self._knobs.jit_post_compile_hook = self._prev_post_hook
        if self._dynamo is not None:
            for callbacks, fn in ((self._dynamo.start_callbacks, self._dynamo_start),
                                  (self._dynamo.end_callbacks, self._dynamo_end)):
                if fn in callbacks:
                    callbacks.remove(fn)


def _triton_name(kwargs: dict) -> str:
    """The kernel's name and its constexprs (one kernel launched with other constexprs is another build), e.g.
    `paged_decode_kernel[HKV=8, GROUP=3, ...]`."""
    fn = kwargs.get("fn")
    arg_names = getattr(getattr(fn, "jit_function", None), "arg_names", None) or []
    constants = (kwargs.get("compile") or {}).get("constants") or {}

    def arg(path) -> str:  # Triton keys constants by their argument's index path: (i,) for argument i
        if isinstance(path, tuple) and len(path) == 1 and isinstance(path[0], int) and path[0] < len(arg_names):
            return arg_names[path[0]]
        return str(path)

    shown = ", ".join(f"{arg(k)}={v}" for k, v in constants.items())
    name = getattr(fn, "name", "?")
    return f"{name}[{shown}]"[:240] if shown else name


def _triton_knobs():
    """Triton's runtime hook slots, or None where Triton (>= 3.4's knobs) is not installed."""
    try:
        from triton import knobs
    except Exception:  # no Triton (a CPU install), or one too old for knobs
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if runtime is not None and hasattr(runtime, "jit_post_compile_hook") else None


def _dynamo_callbacks():
    try:
        from torch._dynamo.callback import callback_handler
    except Exception:  # a torch without compile callbacks
        return None
    return callback_handler
