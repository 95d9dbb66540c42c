"""Kernels built while serving: the first-use costs a live request pays.

A Triton kernel is built once per process for each specialization it is launched with (its constexprs, which
integer arguments are 1 or divisible by 16, the dtypes): compiled, or loaded from Triton's on-disk cache, which is
faster but still milliseconds to tens of them. A `torch.compile`d function compiles again for a shape or mode its
guards have not seen (through inductor, whose FX-graph cache plays the disk cache's part). Start-up's warm-up is meant
to build every kernel serving needs; one that serving builds instead stalls the thread that launched it, the engine
loop or the codec, and with it every stream in flight. On a fresh machine (empty caches, as after a deploy) such a
build costs the most.

`BuildWatch` calls `on_build(kind, name, start, seconds)` after every such build (monotonic seconds; kind "triton"
or "dynamo"), from whichever thread built it. Every watch of a process shares one set of hooks, installed with the
first watch and removed with the last, whatever order they close in (a process may run several pipelines: the
tests); Triton keeps one hook a slot, and those hooks chain to whatever was installed there before. Dynamo reports
one start and one end for compiles that overlap (one counter for the process): they count as one build, from the
first start to the last end. Not timed: builds inside Triton's asynchronous compile mode (which the engine does not
use); dynamo's callbacks after `torch._dynamo.reset()`, which clears them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

OnBuild = Callable[[str, str, float, float], None]


class BuildWatch:
    """Calls `on_build` after every Triton specialization and dynamo compilation this process builds while
    installed; `close()` removes it."""

    def __init__(self, on_build: OnBuild) -> None:
        self._on_build = on_build
        _HOOKS.add(self)

    def close(self) -> None:
        _HOOKS.remove(self)


class _Hooks:
    """The process's one set of build hooks, shared by every open `BuildWatch`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: list[BuildWatch] = []
        self._local = threading.local()  # this thread's Triton build in progress: name -> start
        self._dynamo_start: float | None = None  # dynamo's compiles in progress began (one counter a process)
        self._knobs = self._dynamo = None
        self._prev_cache_hook = self._prev_post_hook = None

    def add(self, watch: BuildWatch) -> None:
        with self._lock:
            if not self._watches:
                self._install()
            self._watches.append(watch)

    def remove(self, watch: BuildWatch) -> None:
        with self._lock:
            if watch not in self._watches:
                return
            self._watches.remove(watch)
            if not self._watches:
                self._uninstall()

    def _install(self) -> None:
        self._knobs, self._dynamo = _triton_knobs(), _dynamo_callbacks()
        if self._knobs is not None:
            self._prev_cache_hook, self._prev_post_hook = self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._triton_start, self._triton_end
        if self._dynamo is not None:
            self._dynamo.register_start_callback(self._dynamo_started)
            self._dynamo.register_end_callback(self._dynamo_ended)

    def _uninstall(self) -> None:
        if self._knobs is not None and self._knobs.jit_cache_hook == self._triton_start:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._prev_cache_hook, self._prev_post_hook
        if self._dynamo is not None:
            for callbacks, fn in ((self._dynamo.start_callbacks, self._dynamo_started),
                                  (self._dynamo.end_callbacks, self._dynamo_ended)):
                if fn in callbacks:
                    callbacks.remove(fn)
        self._dynamo_start = None

    def _triton_start(self, *args, **kwargs):
        """Triton's in-memory cache missed (it returns None: build it, or True: skip the build, as a chained hook
        may say)."""
        starts = getattr(self._local, "starts", None)
        if starts is None:
            starts = self._local.starts = {}
        starts[_triton_name(kwargs)] = time.monotonic()
        return self._prev_cache_hook(*args, **kwargs) if self._prev_cache_hook else None

    def _triton_end(self, *args, **kwargs):
        name = _triton_name(kwargs)
        start = getattr(self._local, "starts", {}).pop(name, None)
        if start is not None:  # (None: it began before the hooks were installed)
            self._report("triton", name, start)
        return self._prev_post_hook(*args, **kwargs) if self._prev_post_hook else None

    def _dynamo_started(self, args) -> None:
        self._dynamo_start = time.monotonic()

    def _dynamo_ended(self, args) -> None:
        start, self._dynamo_start = self._dynamo_start, None
        if start is not None:
            self._report("dynamo", str(getattr(args, "compile_id", "?")), start)

    def _report(self, kind: str, name: str, start: float) -> None:
        seconds = time.monotonic() - start
        with self._lock:
            watches = list(self._watches)
        for watch in watches:
            try:
                watch._on_build(kind, name, start, seconds)
            except Exception:  # a hook runs inside Triton's or dynamo's build: never fail the kernel for a metric
                log.exception("kernel build callback failed")


_HOOKS = _Hooks()


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
