"""What runs when: the scenarios of a run (`LoadConfig`), Poisson arrival times (open loop), and
each client process's share of a scenario (`Part`: arrivals or closed-loop workers)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

TEXT = ("The quick brown fox jumps over the lazy dog while the morning train rolls into the station, "
        "and she said good morning, how are you today, before the whole sentence had been spoken.")


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of a Poisson process of `rate` per second in [0, duration_s)."""
    assert rate > 0 and duration_s > 0, f"rate and duration must be > 0, got {rate}, {duration_s}"
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class Scenario:
    kind: str  # "open" | "closed"
    load: float  # open: requests per second; closed: concurrent streams
    duration_s: float
    seed: int = 0
    count: int | None = None  # closed: at most this many requests per worker

    @property
    def name(self) -> str:
        return f"open@{self.load:g}/s" if self.kind == "open" else f"closed@{int(self.load)}"


@dataclass
class Part:
    """One process's share of a scenario (picklable)."""

    url: str
    kind: str
    text: str
    options: dict
    seed: int
    request_timeout_s: float
    duration_s: float
    drain_s: float
    arrivals: list[tuple[int, float]] = field(default_factory=list)  # open: (request index, s from t0)
    workers: list[tuple[int, float]] = field(default_factory=list)  # closed: (worker index, start s from t0)
    count: int | None = None
    busy_backoff_s: float = 1.0
    prewarm: int = 0  # open: connections opened before t0


@dataclass(frozen=True)
class LoadConfig:
    url: str
    open_rates: tuple[float, ...] = (1, 5, 10, 20)
    closed: tuple[int, ...] = (16, 64, 128, 256, 512)
    duration_s: float = 20.0
    count: int | None = None  # closed: requests per worker at most
    seed: int = 0
    procs: int = 4
    text: str = TEXT
    mode: str | None = None  # None: the server's default
    request_timeout_s: float = 120.0
    drain_s: float = 60.0  # after --duration, how long in-flight requests may take to finish
    ramp_s: float = 1.0
    busy_backoff_s: float = 1.0  # the server's Retry-After
    prewarm_s: float = 1.0  # open: connections opened before t0 = rate x this
    warmup: int = 2
    time_budget_s: float | None = None
    gpu_index: int | tuple[int, ...] = 0  # several: the GPUs of a Ray Serve run, averaged

    def __post_init__(self) -> None:
        checks = {"open rates must be > 0": all(r > 0 for r in self.open_rates),
                  "closed-loop N must be >= 1": all(n >= 1 for n in self.closed),
                  "duration, request timeout and ramp must be > 0, drain >= 0":
                      self.duration_s > 0 and self.request_timeout_s > 0 and self.ramp_s >= 0 and self.drain_s >= 0,
                  "procs must be >= 0 (0: one thread in this process)": self.procs >= 0,
                  "count and warmup must be >= 0": (self.count or 0) >= 0 and self.warmup >= 0}
        bad = [what for what, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"bad load-generator settings: {'; '.join(bad)} ({self})")

    def scenarios(self) -> list[Scenario]:
        return ([Scenario("open", r, self.duration_s, self.seed) for r in self.open_rates]
                + [Scenario("closed", n, self.duration_s, self.seed, self.count) for n in self.closed])


def parts_for(cfg: LoadConfig, sc: Scenario, procs: int, drain_s: float) -> list[Part]:
    """Split a scenario over `procs` clients: arrivals and workers round-robin."""
    options = {"mode": cfg.mode} if cfg.mode else {}
    parts = [Part(url=cfg.url, kind=sc.kind, text=cfg.text, options=options, seed=sc.seed * 1_000_003,
                  request_timeout_s=cfg.request_timeout_s, duration_s=sc.duration_s, drain_s=drain_s,
                  count=sc.count, busy_backoff_s=cfg.busy_backoff_s) for _ in range(procs)]
    if sc.kind == "open":
        for i, at in enumerate(poisson_arrivals(sc.load, sc.duration_s, sc.seed)):
            parts[i % procs].arrivals.append((i, at))
        for p in parts:
            p.prewarm = math.ceil(sc.load * cfg.prewarm_s / procs)
    else:
        n = int(sc.load)
        ramp = min(cfg.ramp_s, sc.duration_s / 2)
        for w in range(n):
            parts[w % procs].workers.append((w, ramp * w / n))
    return parts
