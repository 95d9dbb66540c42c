"""The load generator (higgs_stream/loadgen/): the simulated real-time listener on hand-made
arrival timelines (exact stall counts and durations), the Poisson schedule, the per-scenario
summary, and end to end against a real in-process `random:tiny` server on loopback (open and
closed loop, 2 client processes; `busy` refusals counted apart from errors)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import sys

import aiohttp
import pytest
from higgs_stream.engine.random_weights import build_random
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.metrics import Metrics, UnderrunMeter
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.stream.server import bound_port, serve
from higgs_stream.stream.server_state import ServerState
from higgs_stream.stream.voices import VoiceLibrary

from higgs_stream.loadgen.__main__ import main
from higgs_stream.loadgen.listener import Playback, listen
from higgs_stream.loadgen.report import summarize, table
from higgs_stream.loadgen.runner import run
from higgs_stream.loadgen.schedule import (
    LoadConfig,
    Scenario,
    parts_for,
    poisson_arrivals,
)
from higgs_stream.loadgen.spawn import healthz, spawned_server

MAX_FRAMES, HOP = 20, 960


# ------------------------------------------------------------------------------ the listener
def test_listener_on_time_never_stalls():
    # 1000 samples/s; each 1 s chunk arrives exactly when the previous one runs out
    p = listen([(10.0, 1000), (11.0, 1000), (12.0, 1000), (13.0, 1000)], sample_rate=1000)
    assert (p.first, p.samples, p.underruns, p.stall_s, p.max_gap_s) == (10.0, 4000, 0, 0.0, 1.0)


def test_listener_stalls_and_resumes_when_data_arrives():
    p = listen([(0.0, 500),     # plays 0 .. 0.5
                (1.0, 500),     # needed at 0.5: stall 0.5, plays 1.0 .. 1.5
                (1.25, 250),    # early: plays 1.5 .. 1.75
                (2.0, 100),     # needed at 1.75: stall 0.25, plays 2.0 .. 2.1
                (2.05, 1000)],  # early
               sample_rate=1000)
    assert p.stalls == (0.5, 0.25)
    assert p.stalls_at == (0.5, 1.25)  # seconds of audio played before each stall
    assert (p.underruns, p.stall_s, p.max_stall_s, p.samples, p.max_gap_s) == (2, 0.75, 0.5, 2350, 1.0)


def test_listener_counts_from_the_resume_point_not_the_start():
    # after a 2 s stall the playout clock restarts at t=3: audio at 3.5 is early, at 5.5 late by 0.5
    p = listen([(0.0, 1000), (3.0, 1000), (3.5, 1000), (5.5, 10)], sample_rate=1000)
    assert p.stalls == (2.0, 0.5)


def test_listener_edge_cases():
    assert listen([]) == Playback(None, 0, (), 0.0)
    assert listen([(1.0, 0), (2.0, 0)]).first is None  # empty frames are not audio
    burst = listen([(0.0, 24000)] + [(0.001 * i, 2400) for i in range(1, 10)])  # everything up front
    assert (burst.underruns, burst.samples) == (0, 24000 + 9 * 2400)
    late_first = listen([(5.0, 24), (5.0, 24)], sample_rate=24)  # playback starts at the first audio
    assert (late_first.first, late_first.underruns) == (5.0, 0)


def test_listener_agrees_with_the_servers_underrun_meter():
    rng = random.Random(3)
    for _ in range(200):
        t, arrivals = 0.0, []
        for _ in range(rng.randint(1, 30)):
            t += rng.expovariate(8.0)
            arrivals.append((t, rng.choice((960, 1920, 4800, 9600))))
        meter = UnderrunMeter(24000)
        late = sum(meter.chunk(at, n) for at, n in arrivals)
        p = listen(arrivals)
        assert p.underruns == late == meter.underruns
        assert p.max_gap_s == pytest.approx(meter.max_gap_s)


# ------------------------------------------------------------------------------ schedules and summaries
def test_poisson_schedule_is_reproducible_with_the_right_rate():
    a, b, c = (poisson_arrivals(20.0, 500.0, seed) for seed in (7, 7, 8))
    assert a == b and a != c
    assert all(0 <= x < 500.0 for x in a) and a == sorted(a)
    assert len(a) / 500.0 == pytest.approx(20.0, rel=0.03)  # 10000 expected, sd 1 %
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.03)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.05)  # exponential: CV 1


def test_parts_split_every_arrival_and_worker_once():
    cfg = LoadConfig(url="ws://x/v1/tts/stream", ramp_s=1.0, prewarm_s=1.0, mode="low_latency")
    sc = Scenario("open", 30.0, 4.0, seed=2)
    parts = parts_for(cfg, sc, 3, drain_s=5.0)
    got = sorted(a for p in parts for a in p.arrivals)
    assert got == list(enumerate(poisson_arrivals(30.0, 4.0, 2)))
    assert all(p.prewarm == 10 and p.options == {"mode": "low_latency"} and p.drain_s == 5.0 for p in parts)
    closed = parts_for(cfg, Scenario("closed", 10, 4.0), 4, drain_s=1.0)
    workers = sorted(w for p in closed for w in p.workers)
    assert [w for w, _ in workers] == list(range(10)) and [len(p.workers) for p in closed] == [3, 3, 2, 2]
    assert workers[-1][1] == pytest.approx(0.9)  # started over the ramp


def _rec(outcome, ttfa=None, samples=0, stalls=(), code=None):
    return {"id": 0, "scheduled": 0.0, "sent": 0.001, "first_audio": ttfa, "done": 1.0, "outcome": outcome,
            "error_code": code, "samples": samples, "ttfa_s": ttfa, "underruns": len(stalls),
            "stall_s": sum(stalls), "max_stall_s": max(stalls, default=0.0), "connect_s": None}


def test_summary_counts_busy_apart_from_errors():
    recs = [_rec("completed", 0.1, 24000), _rec("completed", 0.2, 24000, stalls=(0.06,)),
            _rec("completed", 0.3, 24000, stalls=(0.02, 0.15)), _rec("busy", code="busy"),
            _rec("error", code="internal"), _rec("timeout")]
    s = summarize(Scenario("closed", 4, 2.0), recs, wall_s=2.0, gpu=[50.0, 100.0], lags=[{"loop_lag_s_max": 0.003}])
    assert (s["requests"], s["completed"], s["errored"], s["busy"], s["timed_out"]) == (6, 3, 2, 1, 1)
    assert s["error_codes"] == {"busy": 1, "internal": 1}
    assert s["ttfa_ms"]["p50"] == pytest.approx(200) and s["ttfa_ms"]["n"] == 3
    assert (s["underruns"], s["streams_with_underrun"], s["underrun_share"]) == (3, 2, pytest.approx(2 / 3))
    assert s["continuity"] == {"50": pytest.approx(1 / 3), "100": pytest.approx(2 / 3), "200": 1.0}
    assert (s["audio_s"], s["audio_s_per_s"], s["gpu_busy"]) == (3.0, 1.5, 0.75)
    assert s["client"]["loop_lag_ms_max"] == pytest.approx(3.0)
    assert summarize(Scenario("open", 1, 1.0), [], 1.0, None, [])["gpu_busy"] is None


def test_closed_loop_ttfa_apart_from_the_first_wave():
    """Closed loop: each worker's first request with audio arrives with every other worker's (the ramp);
    `ttfa_later_ms` is the TTFA of the requests after it. Open loop has no such wave (None)."""
    def rec(worker, sent, ttfa):
        return {**_rec("completed", ttfa, 24000), "worker": worker, "sent": sent}

    recs = [rec(0, 0.0, 0.4), rec(1, 0.1, 0.5), rec(0, 3.0, 0.2), rec(1, 3.5, 0.1), rec(0, 6.0, 0.3),
            {**_rec("busy", code="busy"), "worker": 2, "sent": 0.2}, rec(2, 1.3, 0.6)]
    s = summarize(Scenario("closed", 3, 10.0), recs, wall_s=10.0, gpu=None, lags=[])
    assert s["ttfa_ms"]["n"] == 6 and s["ttfa_later_ms"]["n"] == 3
    assert s["ttfa_later_ms"]["p50"] == pytest.approx(200) and s["ttfa_later_ms"]["max"] == pytest.approx(300)
    assert summarize(Scenario("open", 1, 1.0), recs, 1.0, None, [])["ttfa_later_ms"] is None


def test_requests_per_replica_and_a_refused_upgrade_is_busy():
    """Behind Ray Serve each connection names its replica, and the proxy refuses an upgrade over
    capacity with 503: that is `busy`, not an error."""
    from higgs_stream.loadgen.client import _refusal

    recs = [{**_rec("completed", 0.1, 24000), "replica": r} for r in ("a", "b", "a")] + [_rec("busy", code="busy")]
    s = summarize(Scenario("closed", 4, 1.0), recs, wall_s=1.0, gpu=None, lags=[])
    assert s["replicas"] == {"a": 2, "b": 1} and s["busy"] == 1
    refused = aiohttp.WSServerHandshakeError(request_info=None, history=(), status=503, message="busy")
    assert _refusal(refused) == ("busy", "busy")
    assert _refusal(aiohttp.WSServerHandshakeError(request_info=None, history=(), status=500)) == (
        "error", "connect: WSServerHandshakeError")
    assert _refusal(ConnectionRefusedError()) == ("error", "connect: ConnectionRefusedError")


def test_time_budget_skips_what_would_not_fit(capsys):
    cfg = LoadConfig(url="ws://127.0.0.1:9/v1/tts/stream", open_rates=(5.0,), closed=(4,), duration_s=30.0, procs=0,
                     warmup=0, time_budget_s=10.0)
    result = run(cfg)  # nothing is sent: port 9 is never asked
    assert result["scenarios"] == [] and result["skipped"] == ["open@5/s", "closed@4"]
    assert "skipped (time budget)" in table(result)
    with pytest.raises(SystemExit):
        main(["--open-rates", "0", "--closed", ""])
    assert "open rates must be > 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------ end to end on loopback
@pytest.fixture(scope="module")
def tiny():
    return build_random("random:tiny", arch="v3", device="cpu")


async def _serve(tiny, **cfg):
    engine, codec = tiny
    config = ServerConfig(port=0, max_frames=MAX_FRAMES, history_segments=0, **{"admit_step_ratio": None, **cfg})
    metrics = Metrics()
    state = ServerState(config, Pipeline(engine, codec, config, metrics), VoiceLibrary.from_config(config), metrics)
    runner = await serve(state, "127.0.0.1", 0)
    return runner, f"ws://127.0.0.1:{bound_port(runner)}/v1/tts/stream"


SCENARIO_KEYS = {"name", "kind", "load", "duration_s", "seed", "count", "requests", "completed", "errored", "busy",
                 "timed_out", "error_codes", "ttfa_ms", "ttfa_later_ms", "underruns", "underrun_s", "streams_with_audio",
                 "streams_with_underrun", "underrun_share", "max_stall_ms", "continuity", "audio_s", "wall_s",
                 "audio_s_per_s", "samples_per_stream", "gpu_busy", "gpu_samples", "replicas", "client", "streams"}
STREAM_KEYS = {"id", "proc", "worker", "scheduled", "sent", "first_audio", "done", "outcome", "reason", "error_code",
               "samples", "server_samples", "underruns", "stall_s", "max_stall_s", "stalls", "stalls_at", "max_gap_s",
               "connect_s", "ttfa_s", "replica"}


async def test_open_and_closed_loop_against_a_live_server(tiny, tmp_path):
    runner, url = await _serve(tiny)
    try:
        cfg = LoadConfig(url=url, open_rates=(4.0,), closed=(2,), duration_s=1.5, seed=1, procs=2, warmup=1,
                         request_timeout_s=30.0, drain_s=30.0)
        result = await asyncio.to_thread(run, cfg)
    finally:
        await runner.cleanup()
    engine = tiny[0]
    assert engine.num_active == 0 and engine.cache.allocator.num_used == 0, "KV pages leaked"

    result = json.loads(json.dumps(result))  # what --out writes
    assert {"schema", "url", "started", "host", "config", "server", "server_after", "gpu_source", "warmup",
            "scenarios", "skipped", "wall_s"} <= set(result)
    assert result["server_after"]["active_streams"] == 0
    assert result["server"]["status"] == "ok" and result["skipped"] == []
    assert [s["name"] for s in result["scenarios"]] == ["open@4/s", "closed@2"]
    open_, closed = result["scenarios"]
    assert open_["requests"] == len(poisson_arrivals(4.0, 1.5, 1)) > 0
    assert closed["requests"] >= 2 and {r["worker"] for r in closed["streams"]} == {0, 1}
    for s in result["scenarios"]:
        assert set(s) == SCENARIO_KEYS and set(s["ttfa_ms"]) == {"n", "p50", "p95", "p99", "mean", "max"}
        assert set(s["continuity"]) == {"50", "100", "200"}
        assert s["completed"] == s["requests"] == s["streams_with_audio"] and s["errored"] == s["busy"] == 0
        assert 0 < s["ttfa_ms"]["p50"] <= s["ttfa_ms"]["p95"] <= s["ttfa_ms"]["p99"] <= s["ttfa_ms"]["max"]
        assert s["audio_s"] > 0 and s["audio_s_per_s"] > 0 and s["gpu_busy"] is None
        assert {r["proc"] for r in s["streams"]} == {0, 1}  # both client processes sent requests
        for r in s["streams"]:
            assert set(r) == STREAM_KEYS
            assert r["samples"] == r["server_samples"] == MAX_FRAMES * HOP  # EOS suppressed: exact lengths
            assert r["ttfa_s"] > 0 and r["first_audio"] >= r["sent"] >= r["scheduled"] - 1e-9
    assert open_["audio_s"] == pytest.approx(open_["requests"] * MAX_FRAMES * HOP / 24000)

    out = tmp_path / "lg.json"
    out.write_text(json.dumps(result))
    assert "closed@2" in table(result)
    rc = main(["--plot-from", str(out), "--plot", str(tmp_path / "lg.png")])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert rc == 1 and not (tmp_path / "lg.png").exists()
    else:
        assert rc == 0 and (tmp_path / "lg.png").stat().st_size > 0


async def test_busy_refusals_are_counted_apart_from_errors(tiny):
    runner, url = await _serve(tiny, max_streams=1)
    try:
        cfg = LoadConfig(url=url, open_rates=(), closed=(3,), duration_s=1.0, count=2, procs=0, warmup=0,
                         ramp_s=0.0, busy_backoff_s=0.05, request_timeout_s=30.0, drain_s=30.0)
        result = await asyncio.to_thread(run, cfg)
    finally:
        await runner.cleanup()
    (s,) = result["scenarios"]
    assert s["busy"] > 0 and s["errored"] == 0 and s["completed"] > 0
    assert s["completed"] + s["busy"] == s["requests"] and s["error_codes"] == {"busy": s["busy"]}
    assert all(r["samples"] == MAX_FRAMES * HOP for r in s["streams"] if r["outcome"] == "completed")



async def test_a_load_listed_twice_runs_twice_on_the_same_server(tiny):
    """`--closed 1,1`: two runs of closed@1, one after the other, each its own result (scripts/plot_runs.py reads each
    repeat as a run; scripts/gpu_loadgen_configs.sh repeats on one server instead of starting another)."""
    runner, url = await _serve(tiny)
    try:
        cfg = LoadConfig(url=url, open_rates=(), closed=(1, 1), duration_s=1.0, count=1, procs=0, warmup=0,
                         ramp_s=0.0, request_timeout_s=30.0, drain_s=30.0)
        result = await asyncio.to_thread(run, cfg)
    finally:
        await runner.cleanup()
    assert [s["name"] for s in result["scenarios"]] == ["closed@1", "closed@1"] and not result["skipped"]
    assert [(s["requests"], s["completed"], s["errored"]) for s in result["scenarios"]] == [(1, 1, 0), (1, 1, 0)]
    first, second = (s["streams"][0] for s in result["scenarios"])
    assert first["samples"] == second["samples"] == MAX_FRAMES * HOP

# ------------------------------------------------------------------------------ --spawn
def test_spawned_server_is_waited_for_and_stopped(tmp_path):
    app = ("from aiohttp import web\n"
           "app = web.Application()\n"
           "app.router.add_get('/healthz', lambda r: web.json_response({'status': 'ok'}))\n"
           "web.run_app(app, host='127.0.0.1', port=int(__import__('sys').argv[1]))\n")
    (tmp_path / "app.py").write_text(app)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"ws://127.0.0.1:{port}/v1/tts/stream"
    with spawned_server(f"{sys.executable} {tmp_path / 'app.py'} {port}", url, tmp_path / "s.log", 30) as p:
        assert healthz(url) == {"status": "ok"}
    assert p.returncode is not None and healthz(url) is None


def test_spawned_server_that_dies_reports_its_log(tmp_path):
    cmd = f"{sys.executable} -c \"print('model not found'); raise SystemExit(3)\""
    with (pytest.raises(RuntimeError, match="exited with 3(.|\n)*model not found"),
          spawned_server(cmd, "ws://127.0.0.1:9/v1/tts/stream", tmp_path / "s.log", 30)):
        pass


def test_results_read_back_plain_or_gzipped(tmp_path):
    """--plot-from takes docs/bench's .json.gz as well as .json."""
    import gzip
    import json

    from higgs_stream.loadgen.__main__ import read_result

    result = {"label": "x", "scenarios": [{"kind": "open", "load": 1.0}]}
    plain, packed = tmp_path / "r.json", tmp_path / "r.json.gz"
    plain.write_text(json.dumps(result))
    packed.write_bytes(gzip.compress(json.dumps(result).encode()))
    assert read_result(plain) == read_result(packed) == result
