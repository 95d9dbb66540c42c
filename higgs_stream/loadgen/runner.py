"""A run: every scenario of a `LoadConfig` against a running server, one after another, through
the client processes; the result document (`--out`'s JSON, docs/LOADGEN.md)."""

from __future__ import annotations

import platform
import time
from dataclasses import asdict
from typing import Any

from higgs_stream.loadgen.client import Clients
from higgs_stream.loadgen.gpu import GpuMonitor
from higgs_stream.loadgen.report import brief, log, summarize
from higgs_stream.loadgen.schedule import LoadConfig, Scenario, parts_for
from higgs_stream.loadgen.spawn import healthz, http_base

SCHEMA = 1


def run_scenario(cfg: LoadConfig, clients: Clients, gpu: GpuMonitor, sc: Scenario, drain_s: float) -> dict:
    procs = len(clients.conns)
    parts = parts_for(cfg, sc, procs, drain_s)
    t0, results = clients.run(parts, sc.duration_s + drain_s + cfg.request_timeout_s + 60)
    records = []
    for p, res in enumerate(results):
        for r in res["records"]:
            r["proc"] = p
            records.append(r)
    records.sort(key=lambda r: (r["scheduled"], r["id"]))
    wall = max((r["done"] for r in records), default=sc.duration_s)
    return summarize(sc, records, wall, gpu.window(t0, t0 + wall), results)


def run(cfg: LoadConfig, t_begin: float | None = None) -> dict:
    """Every scenario of `cfg` against a running server; the result document (see docs/LOADGEN.md).
    `t_begin`: when the time budget started (default now; --spawn counts the server's start-up)."""
    t_begin = time.monotonic() if t_begin is None else t_begin
    health = healthz(cfg.url)
    if health is None:
        log(f"warning: {http_base(cfg.url)}/healthz did not answer; trying the WebSocket anyway")
    result: dict[str, Any] = {
        "schema": SCHEMA, "url": cfg.url, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(), "config": {**asdict(cfg), "text_chars": len(cfg.text)}, "server": health,
        "gpu_source": None, "warmup": None, "scenarios": [], "skipped": [],
    }
    clients = Clients(cfg.procs)
    gpu = GpuMonitor(cfg.gpu_index)
    result["gpu_source"] = gpu.source
    try:
        if cfg.warmup:
            warm = Scenario("closed", cfg.warmup, 1.0, cfg.seed + 7, count=1)  # one request per worker
            result["warmup"] = brief(run_scenario(cfg, clients, gpu, warm, cfg.request_timeout_s))
            log(f"warm-up: {result['warmup']}")
        for sc in cfg.scenarios():
            drain = cfg.drain_s
            if cfg.time_budget_s is not None:
                left = cfg.time_budget_s - (time.monotonic() - t_begin) - sc.duration_s - 5
                if left < min(10.0, cfg.drain_s):
                    result["skipped"].append(sc.name)
                    log(f"{sc.name}: skipped (time budget {cfg.time_budget_s:.0f} s)")
                    continue
                drain = min(drain, left)
            log(f"{sc.name}: running for {sc.duration_s:g} s (+ up to {drain:.0f} s to finish)")
            res = run_scenario(cfg, clients, gpu, sc, drain)
            result["scenarios"].append(res)
            log(f"{sc.name}: {brief(res)}")
    finally:
        clients.close()
        gpu.close()
    result["server_after"] = healthz(cfg.url)
    result["wall_s"] = time.monotonic() - t_begin
    return result
