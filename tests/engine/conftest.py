"""Helpers shared by the engine tests."""

from __future__ import annotations

import numpy as np
import pytest


def _run_staggered(engine, requests, admit_at, max_steps: int = 500) -> tuple[list[np.ndarray], list[str]]:
    """Add request i at step admit_at[i] and step until every request finished; returns the codec
    frames [K, F] and the finish reason of each request. Any engine with add/step/has_work (the CPU Engine
    or the GpuEngine, which collects one step late: its trailing steps must yield nothing)."""
    sids: dict[int, int] = {}
    cols: dict[int, list[np.ndarray]] = {}
    reasons: dict[int, str] = {}
    step = 0
    while len(reasons) < len(requests):
        for i, at in enumerate(admit_at):
            if at == step:
                sids[engine.add(requests[i])] = i
        for ev in engine.step():
            i = sids[ev.stream_id]
            if ev.frame is not None:
                cols.setdefault(i, []).append(ev.frame)
            if ev.finished:
                reasons[i] = ev.reason
        step += 1
        assert step < max_steps, "engine did not finish"
    while engine.has_work():
        assert engine.step() == []
    k = engine.cfg.num_codebooks
    frames = [np.stack(cols[i], axis=1) if i in cols else np.zeros((k, 0), np.int64) for i in range(len(requests))]
    return frames, [reasons[i] for i in range(len(requests))]


@pytest.fixture(scope="session")
def run_staggered():
    return _run_staggered
