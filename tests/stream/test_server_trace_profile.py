"""The live server's diagnostic outputs (stream/server.py `serve(trace_out=, profile_out=)`): `serve --trace-out`'s
trace as scripts/ttfa_breakdown.py reads it, and `serve --profile-out`'s thread profile (stream/thread_profile.py)."""

from __future__ import annotations

import json

import aiohttp
import pytest
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.stream.server import bound_port, serve
from higgs_stream.stream.server_state import ServerState
from higgs_stream.stream.voices import VoiceLibrary
from higgs_stream.testing_server import Peer, speak, tiny_codec_engine
from websockets.asyncio.client import connect

MAX_FRAMES = 30

codec, engine = tiny_codec_engine(kv_pages=1024)


async def test_trace_out_records_where_each_first_audio_went(engine, codec, tmp_path):
    """`serve --trace-out`: steps, codec calls and each stream's first audio are written at shutdown,
    and scripts/ttfa_breakdown.py accounts for the stream's time to first audio with them."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "ttfa_breakdown", Path(__file__).parents[2] / "scripts" / "ttfa_breakdown.py")
    ttfa_breakdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ttfa_breakdown)
    config, metrics = ServerConfig(port=0, max_frames=MAX_FRAMES, warm_up=False), Metrics()
    state = ServerState(config, Pipeline(engine, codec, config, metrics), VoiceLibrary.from_config(config), metrics)
    path = tmp_path / "trace.json"
    runner = await serve(state, "127.0.0.1", 0, trace_out=str(path))
    try:
        async with connect(f"ws://127.0.0.1:{bound_port(runner)}/v1/tts/stream") as ws:
            lis = Peer(ws)
            await speak(ws, "t", "Hello there.", 5)
            await lis.until(lambda: "t" in lis.done)
    finally:
        await runner.cleanup()
    events = json.loads(path.read_text())["events"]
    kinds = {e[0] for e in events}
    assert {"step", "codec", "stream"} <= kinds
    (row,) = ttfa_breakdown.breakdown(events)
    assert row["alone"]
    assert row["ttfa_ms"] > 0 and row["steps"] >= 1 and row["prefill_steps"] == 1 and row["codec_calls"] >= 1
    parts = row["idle_ms"] + row["step_ms"] + row["codec_ms"]  # steps and codec calls may overlap
    assert row["ttfa_ms"] - 1e-6 <= parts and row["idle_ms"] >= 0
    # the segment's first frame (frame0 events): first text -> first frame -> its codec call -> first audio
    assert "frame0" in kinds and 0 < row["to_first_frame_ms"] < row["ttfa_ms"] and row["frame_to_call_ms"] >= 0
    steps = [e for e in events if e[0] == "step"]
    # + late prompt launches (none on the CPU runner), sync, the wait for room in the codec's queue
    assert all(len(e) == 10 and e[7] == 0 and 0 <= e[9] <= e[3] - e[1] for e in steps)


def test_ttfa_breakdown_takes_a_context_s_first_segment_frame():
    """Later segments of a context share its first text: their frame0 events must not replace the first's."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "ttfa_breakdown", Path(__file__).parents[2] / "scripts" / "ttfa_breakdown.py")
    ttfa_breakdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ttfa_breakdown)
    events = [["step", 1.000, 1.008, 1.009, 1, 0.0, 1], ["frame0", 1.010, 1.0], ["codec", 1.012, 1.018, 1, 1, 1],
              ["frame0", 2.500, 1.0], ["stream", 1.0, 1.019, 3.0, 48000]]
    (row,) = ttfa_breakdown.breakdown(events)
    assert row["to_first_frame_ms"] == pytest.approx(10.0) and row["frame_to_call_ms"] == pytest.approx(2.0)


async def test_profile_out_samples_the_loop_engine_and_codec_threads(engine, codec, tmp_path):
    """serve --profile-out FILE: the server samples every thread's stack from start-up to clean-up and writes
    the profile there; the event loop, the engine thread and the codec thread are in it, each at its own work."""
    config = ServerConfig(port=0, max_frames=MAX_FRAMES, admit_step_ratio=None)
    metrics = Metrics()
    state = ServerState(config, Pipeline(engine, codec, config, metrics), VoiceLibrary.from_config(config), metrics)
    path = tmp_path / "profile.json"
    runner = await serve(state, "127.0.0.1", 0, profile_out=str(path))
    try:
        async with aiohttp.ClientSession() as http:
            for seed in (3, 4):
                async with http.post(f"http://127.0.0.1:{bound_port(runner)}/v1/audio/speech",
                                     json={"input": "Hello there, this is a longer sentence.", "seed": seed}) as r:
                    assert r.status == 200 and len(await r.read()) > 0
    finally:
        await runner.cleanup()
    prof = json.loads(path.read_text())
    threads = prof["threads"]
    assert prof["samples"] > 0 and {"MainThread", "higgs-engine", "higgs-codec"} <= set(threads)
    assert "higgs-stack-sampler" not in threads
    engine_fns = {k.split(" ")[0] for k, _ in threads["higgs-engine"]["cum"]}
    assert "_engine_loop" in engine_fns
    assert any(k.startswith("_run ") for k, _ in threads["higgs-codec"]["cum"])
