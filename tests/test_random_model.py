"""`serve --model random:tiny [--arch v2|v3]`: a random-weight model built in memory whose EOS is
suppressed, so an utterance runs to exactly --max-frames frames (the same model unsuppressed stops
early for the same seed); random:full's in-memory builder at tiny size on the CPU (the ModelRunner with
the plain-torch kernels); random:full refuses the CPU; the hook's argument checks."""

from __future__ import annotations

import argparse
import json

import aiohttp
import pytest
import torch
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.random_weights import (
    build_random,
    in_memory_engine,
    random_preset,
)
from higgs_stream.engine.request import GenerationRequest, SamplingParams
from higgs_stream.stream import serve_command, server

MAX_FRAMES, HOP = 60, 960
TEXT = "The quick brown fox jumps over the lazy dog"
SEED = 2  # the unsuppressed tiny models (v2 and v3, seed 0) stop after a few frames with this seed


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    return parser.parse_args(["--device", "cpu", *argv])


def test_model_names():
    assert (random_preset("random:tiny"), random_preset("random:full"), random_preset("/models/x")) == ("tiny", "full", None)
    with pytest.raises(ConfigError, match="random:tiny"):
        random_preset("random:huge")
    with pytest.raises(ConfigError, match="CUDA only"):
        build_random("random:full", device="cpu")


@pytest.mark.parametrize("argv, match", [
    (["--model", "random:tiny", "--codec", "/x"], "--codec"),
    (["--model", "/no/such/model", "--arch", "v3"], "--arch applies to --model random"),
])
def test_serve_argument_checks(argv, match):
    with pytest.raises(ConfigError, match=match):
        serve_command.build_state(args(*argv))


@pytest.mark.parametrize("arch, fixture", [("v2", "tiny_ckpt"), ("v3", "tiny_v3_ckpt")])
async def test_random_tiny_serves_exactly_max_frames(arch, fixture, request, caplog):
    # control: the same weights (make-checkpoint tiny, seed 0) without suppression end early
    plain = Engine.from_pretrained(str(request.getfixturevalue(fixture)), config=EngineConfig(kv_pages=256))
    req = GenerationRequest(TEXT, sampling=SamplingParams(seed=SEED), max_frames=MAX_FRAMES)
    assert plain.generate(req).shape[1] < MAX_FRAMES  # codec frames

    with caplog.at_level("WARNING"):
        state = serve_command.build_state(args("--model", "random:tiny", "--arch", arch, "--max-frames", str(MAX_FRAMES)))
    assert "NOISE, NEVER SPEECH" in caplog.text
    assert state.pipeline.engine.generate(req).shape[1] == MAX_FRAMES

    runner = await server.serve(state, "127.0.0.1", 0)
    try:
        url = f"ws://127.0.0.1:{server.bound_port(runner)}/v1/tts/stream"
        pcm, done = bytearray(), None
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
            await ws.send_str(json.dumps({"type": "text", "context_id": "a", "text": TEXT, "seed": SEED}))
            await ws.send_str(json.dumps({"type": "end", "context_id": "a"}))
            for _ in range(10_000):  # bounded: one message per iteration
                msg = await ws.receive(timeout=60)
                if msg.type == aiohttp.WSMsgType.BINARY:
                    pcm += msg.data
                    continue
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                ev = json.loads(msg.data)
                if ev["type"] == "done":
                    done = ev
                    break
    finally:
        await runner.cleanup()
    assert done == {"type": "done", "context_id": "a", "reason": "completed", "samples": MAX_FRAMES * HOP}
    assert len(pcm) == 2 * MAX_FRAMES * HOP


@pytest.mark.parametrize("arch", ["v2", "v3", "qwen3-tts"])
def test_in_memory_builder_of_random_full_at_tiny_size(arch):
    """The code path of random:full (talker drawn in memory, the ModelRunner, EOS rows zeroed in the fast
    path's head, top-k capped), at tiny size on the CPU with kernels="ref" (Qwen3-TTS: what
    `bench --arch qwen3-tts` builds)."""
    config = EngineConfig(kv_pages=256, max_batch=4, token_budget=512)
    engine = in_memory_engine(arch, "tiny", "cpu", torch.float32, config, cuda_graphs=False, kernels="ref")
    cfg = engine.cfg
    head = engine.runner.fast.audio_head
    assert not head.view(-1, cfg.audio_vocab, head.shape[-1])[:, cfg.audio_stream_eos_id].any()
    for seed in range(3):
        req = GenerationRequest(TEXT, sampling=SamplingParams(seed=seed), max_frames=40)
        frames = engine.generate(req).shape[1]
        # tiny Qwen3-TTS: group 0 draws from 64 codes + EOS, so EOS (logit 0) can make the top 50; at full size
        # (2048 codes) it cannot
        assert frames == 40 if arch != "qwen3-tts" else 2 <= frames <= 40
    if arch == "v2":  # control: the same weights with EOS reachable stop early for seed 0
        plain = in_memory_engine(arch, "tiny", "cpu", torch.float32, config, cuda_graphs=False, kernels="ref", eos=True)
        req = GenerationRequest(TEXT, sampling=SamplingParams(seed=0), max_frames=40)
        assert plain.generate(req).shape[1] < 40


def test_serve_flags_reach_the_codec_and_the_pacing_config():
    """--codec-precision tf32 is an explicit opt-in on the codec; the pacing flags land in ServerConfig."""
    state = serve_command.build_state(args("--model", "random:tiny", "--codec-precision", "tf32", "--pause-ahead", "4",
                                    "--resume-ahead", "1.5", "--admit-step-ratio", "0.6", "--yield-ahead", "0.5"))
    assert state.pipeline.codec.allow_tf32 is True
    assert (state.config.pause_ahead_s, state.config.resume_ahead_s, state.config.admit_step_ratio) == (4.0, 1.5, 0.6)
    assert state.config.yield_ahead_s == state.pipeline.pacing.yield_ahead_s == 0.5
    default = serve_command.build_state(args("--model", "random:tiny"))
    assert default.pipeline.codec.allow_tf32 is False  # exact unless asked
    assert default.pipeline.pacing.yield_ahead_s == 1.0
    assert serve_command.build_state(args("--model", "random:tiny", "--yield-ahead", "-1")).pipeline.pacing.yield_ahead_s is None


def test_the_codec_gemm_flag_reaches_the_stateful_decoder():
    """--codec-gemm-max-rate-out sets which stages the Higgs decoder would run as GEMMs (on CUDA; a CPU decoder keeps
    PyTorch's convolutions either way); refused below 1 (and by a Qwen3-TTS codec: tests/stream/test_qwen3_tts.py)."""
    from higgs_stream.engine.codec.streaming import GEMM_MAX_RATE_OUT, gemm_stage

    state = serve_command.build_state(args("--model", "random:tiny", "--codec-gemm-max-rate-out", "1"))
    codec = state.pipeline.codec
    assert codec.gemm_max_rate_out == 1
    dec = codec.streaming_decoder(2)
    assert dec.gemm_stages == 0  # CPU
    assert sum(gemm_stage(st, 1) for st in dec.stages) == 1 and sum(gemm_stage(st) for st in dec.stages) == 9
    assert serve_command.build_state(args("--model", "random:tiny")).pipeline.codec.gemm_max_rate_out is None
    assert GEMM_MAX_RATE_OUT == 40
    with pytest.raises(ConfigError, match=">= 1"):
        serve_command.build_state(args("--model", "random:tiny", "--codec-gemm-max-rate-out", "0"))


def test_serve_quantize_flag_reaches_the_engine():
    from higgs_stream.engine.quantize import QuantLinear

    state = serve_command.build_state(args("--model", "random:tiny", "--arch", "v3", "--quantize", "int8"))
    talker = state.pipeline.engine.talker
    assert {n for n, m in talker.named_modules() if isinstance(m, QuantLinear)} == set(talker.backbone_linears())
    with pytest.raises(ConfigError, match="compute capability"):
        serve_command.build_state(args("--model", "random:tiny", "--quantize", "fp8"))
    with pytest.raises(SystemExit):  # argparse: not a mode
        args("--model", "random:tiny", "--quantize", "int4")
