"""`serve`'s start-up checks (stream/serve_command.py): each mistake a probe found ended in a traceback, some only
after the model had loaded or at shutdown; each is one ConfigError now (the CLI prints it, exit code 2). And its
arguments: `serve --help`'s defaults, the flags that reach the ServerConfig."""

from __future__ import annotations

import argparse
import re
import socket

import numpy as np

import pytest
import soundfile as sf
import torch
from higgs_stream.engine.errors import ConfigError
from higgs_stream.stream import serve_command
from higgs_stream.stream.config import ServerConfig


@pytest.mark.parametrize("name, says", [
    ("bogus", "is not a device"),
    ("meta", "runs on cpu or cuda"),
    ("cuda:99", "CUDA GPU"),
])
def test_a_device_this_machine_lacks_is_a_config_error(name, says):
    with pytest.raises(ConfigError, match=says):
        serve_command.check_device(name)
    serve_command.check_device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU has cuda")
def test_cuda_without_a_gpu_is_a_config_error():
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        serve_command.check_device("cuda")


def test_a_taken_port_is_a_config_error_before_the_model_loads():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve_command.check_listen("127.0.0.1", port)
    serve_command.check_listen("127.0.0.1", 0)


def test_output_files_need_a_writable_folder(tmp_path):
    with pytest.raises(ConfigError, match="does not exist or is not writable"):
        serve_command.check_output_path("--trace-out", str(tmp_path / "missing" / "trace.json"))
    with pytest.raises(ConfigError, match="is a folder"):
        serve_command.check_output_path("--profile-out", str(tmp_path))
    serve_command.check_output_path("--trace-out", str(tmp_path / "trace.json"))
    serve_command.check_output_path("--trace-out", None)


def test_a_kv_cache_too_small_for_one_stream_is_a_config_error(tiny_ckpt):
    """--kv-pages 1: every request was refused busy with Retry-After, forever, and /healthz said ok."""
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_ckpt), "--device", "cpu", "--kv-pages", "1", "--max-frames", "100"])
    with pytest.raises(ConfigError, match="the KV cache has 1 pages; one stream of --max-frames 100 needs at least"):
        serve_command.build_state(args)



@pytest.mark.parametrize("flags, says", [
    (["--kv-pages", "0"], "--kv-pages must be at least 1, got 0"),  # 0 silently meant the default 4096
    (["--kv-pages", "1000000000000"], r"the KV cache \(1000000000000 pages: .* GiB\) does not fit on cpu"),  # a traceback
    (["--max-streams", "100000000"], "--max-streams 100000000: at most 2048"),  # said token_budget (2048) >= max_batch
])
def test_kv_pages_and_max_streams_out_of_range_are_config_errors(tiny_ckpt, flags, says):
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    with pytest.raises(ConfigError, match=says):
        serve_command.build_state(parser.parse_args(["--model", str(tiny_ckpt), "--device", "cpu", *flags]))


def test_a_voices_path_that_is_a_file_says_so(tmp_path):
    (tmp_path / "voices.txt").write_text("not a folder")
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    args = parser.parse_args(["--model", "/nonexistent", "--device", "cpu", "--voices", str(tmp_path / "voices.txt")])
    with pytest.raises(ConfigError, match="voices folder .*voices.txt is not a folder"):
        serve_command.build_state(args)

def test_a_control_token_in_a_preset_transcript_is_a_config_error(tiny_ckpt, tmp_path):
    """A preset whose transcript held `<|eot_id|>` passed start-up, then every request in that voice failed; now the
    engine's own check (the one a request's reference gets) refuses it at start-up, naming the file."""
    t = np.arange(4800) / 24000
    sf.write(tmp_path / "good.wav", (0.25 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 24000)
    (tmp_path / "good.txt").write_text("Hello there.")
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_ckpt), "--device", "cpu", "--voices", str(tmp_path)])
    state = serve_command.build_state(args)
    assert list(state.voices.presets) == ["good"] and state.voices.resolve("GOOD").transcript == "Hello there."
    (tmp_path / "good.txt").write_text("Hello <|eot_id|> there.")
    with pytest.raises(ConfigError, match=re.escape(f"voice preset {tmp_path / 'good.txt'}: transcript contains "
                                                    f"chat/audio control tokens (ids [")):
        serve_command.build_state(args)


def test_serve_help_shows_the_default_address():
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    d = ServerConfig()
    assert f"(default {d.host})" in text and f"(default {d.port})" in text


def test_serve_flags_reach_the_codec_schedule_and_green_context():
    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    cfg = serve_command.config_from_args(parser.parse_args(["--model", "x"]))
    assert cfg.codec_schedule == "eager" and cfg.codec_sms is None
    cfg = serve_command.config_from_args(parser.parse_args(["--model", "x", "--codec-schedule", "just_in_time", "--codec-sms", "48"]))
    assert cfg.codec_schedule == "just_in_time" and cfg.codec_sms == 48
    assert cfg.codec_queue_rounds == 4  # the default, every family's
    cfg = serve_command.config_from_args(parser.parse_args(["--model", "x", "--codec-queue-rounds", "64"]))
    assert cfg.codec_queue_rounds == 64
