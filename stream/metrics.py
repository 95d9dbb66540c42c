"""Prometheus metrics in the text exposition format (0.0.4), written by hand: counters, gauges and
histograms with optional labels. Thread-safe (the engine thread observes step times)."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

TTFA_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)
GC_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
STEP_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0)


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        assert set(labels) == set(self.label_names), f"{self.name}: labels {sorted(labels)} != {self.label_names}"
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name, help, labels=()):
        super().__init__(name, help, labels)
        self._values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        assert amount >= 0, f"{self.name}: counters only go up"
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels(self.label_names, k)} {_fmt(v)}" for k, v in items]

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """(series name, labels, value) of every series, as `render` shows them."""
        with self._lock:
            items = sorted(self._values.items())
        return [(self.name, dict(zip(self.label_names, k)), v) for k, v in items]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name, help, buckets: Sequence[float]):
        super().__init__(name, help)
        assert list(buckets) == sorted(buckets) and len(set(buckets)) == len(buckets), "buckets must increase"
        self.buckets = (*buckets, math.inf)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, upper in enumerate(self.buckets):
                if value <= upper:
                    self._counts[i] += 1
                    break
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    @property
    def sum(self) -> float:
        return self._sum

    def samples(self) -> list[tuple[str, dict[str, str], float]]:
        """(series name, labels, value): the cumulative buckets (label `le`), `_sum` and `_count`."""
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        out, running = [], 0
        for upper, c in zip(self.buckets, counts):
            running += c
            out.append((f"{self.name}_bucket", {"le": _fmt(upper)}, float(running)))
        return [*out, (f"{self.name}_sum", {}, total), (f"{self.name}_count", {}, float(n))]

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        lines, running = [], 0
        for upper, c in zip(self.buckets, counts):
            running += c
            lines.append(f'{self.name}_bucket{{le="{_fmt(upper)}"}} {running}')
        lines += [f"{self.name}_sum {_fmt(total)}", f"{self.name}_count {n}"]
        return lines


class Metrics:
    """Everything /metrics shows."""

    def __init__(self):
        self.active_streams = Gauge("higgs_active_streams", "Contexts and HTTP requests in flight.")
        self.engine_streams = Gauge("higgs_engine_streams", "Segments being generated by the engine.")
        self.connections = Gauge("higgs_connections", "Open WebSocket connections.")
        self.kv_pages_used = Gauge("higgs_kv_pages_used", "KV cache pages held by streams (after the last engine step).")
        self.kv_pages_free = Gauge("higgs_kv_pages_free", "KV cache pages free (after the last engine step).")
        self.requests = Counter("higgs_requests_total", "Streams by transport and outcome.", ("transport", "outcome"))
        self.errors = Counter("higgs_errors_total", "Errors sent to clients, by code.", ("code",))
        self.ttfa = Histogram("higgs_ttfa_seconds", "Time from a segment's text being ready to its first audio.",
                              TTFA_BUCKETS)
        self.step_time = Histogram("higgs_step_seconds", "Engine step plus codec decode, per step.", STEP_BUCKETS)
        self.underruns = Counter("higgs_underruns_total",
                                 "Times a stream's audio fell behind real time after its first chunk.")
        self.slow_clients = Counter("higgs_slow_client_total", "Streams ended because the client did not read.")
        self.audio_seconds = Counter("higgs_audio_seconds_total", "Seconds of audio delivered to streams.")
        self.steps = Counter("higgs_steps_total", "Engine steps run.")
        self.paused_streams = Gauge("higgs_paused_streams",
                                    "Streams the talker skips: far ahead of their listener while the GPU is saturated.")
        self.refused = Counter("higgs_refused_saturated_total",
                               "Streams refused (busy) because one more would slow every stream below the admission ratio.")
        self.gpu_memory_cap = Gauge("higgs_gpu_memory_cap_bytes",
                                    "The serving process's GPU memory bound (--gpu-headroom-gb; 0: none, or no GPU).")
        self.gpu_memory_reserved = Gauge("higgs_gpu_memory_reserved_bytes",
                                         "GPU memory torch's allocator holds for the process (after the last step).")
        self.gc_pause = Histogram("higgs_gc_pause_seconds",
                                  "Python garbage collections: every thread of the server stops for each.", GC_BUCKETS)
        self.kernel_builds = Counter("higgs_kernel_builds_total",
                                     "Kernels built while serving (a Triton specialization or a torch.compile graph the "
                                     "warm-up did not build): each stalled its thread once.", ("kind",))
        self.kernel_build_seconds = Counter("higgs_kernel_build_seconds_total",
                                            "Seconds spent building kernels while serving.", ("kind",))
        for kind in ("triton", "dynamo"):  # a sample at 0 from the start: a rate sees the first build
            self.kernel_builds.inc(0, kind=kind)
            self.kernel_build_seconds.inc(0, kind=kind)
        self.codec_call_time = Histogram("higgs_codec_call_seconds",
                                         "Codec decode calls (one batched call serves many streams' due frames).",
                                         STEP_BUCKETS)
        self.codec_backlog = Gauge("higgs_codec_backlog_frames",
                                   "Codec frames made by the talker and held undecoded (after the last codec call).")
        self.codec_overdue_wait = Histogram("higgs_codec_overdue_wait_seconds",
                                            "Codec calls holding an overdue job (a first chunk, a dry listener): how "
                                            "long past its deadline that job was when the call began.", STEP_BUCKETS)

    def all(self) -> list[_Metric]:
        return [self.active_streams, self.engine_streams, self.connections, self.kv_pages_used, self.kv_pages_free,
                self.requests, self.errors,
                self.ttfa, self.step_time, self.underruns, self.slow_clients, self.audio_seconds, self.steps,
                self.paused_streams, self.refused, self.gpu_memory_cap, self.gpu_memory_reserved, self.gc_pause,
                self.kernel_builds, self.kernel_build_seconds, self.codec_call_time, self.codec_backlog,
                self.codec_overdue_wait]

    def render(self) -> str:
        lines: list[str] = []
        for metric in self.all():
            lines += metric.header() + metric.render()
        return "\n".join(lines) + "\n"


class UnderrunMeter:
    """Per-segment real-time check: a listener that starts playing at the first chunk underruns
    whenever a later chunk arrives after all audio delivered so far has played out."""

    def __init__(self, sample_rate: int):
        self.sample_rate = sample_rate
        self.start: float | None = None
        self.delivered_s = 0.0
        self.underruns = 0
        self.max_gap_s = 0.0
        self._last: float | None = None

    def chunk(self, now: float, samples: int) -> bool:
        """Record a chunk arriving at `now`; True when it came after the playout ran dry."""
        late = False
        if self.start is None:
            self.start = now
        else:
            self.max_gap_s = max(self.max_gap_s, now - self._last)
            if now - self.start > self.delivered_s:
                self.underruns += 1
                late = True
                self.start = now - self.delivered_s  # the listener resumes from here
        self._last = now
        self.delivered_s += samples / self.sample_rate
        return late
