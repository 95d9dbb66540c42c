"""ServerConfig: the limits added for hostile input are validated fields with `serve` flags."""

from __future__ import annotations

import argparse

import pytest
from higgs_stream.engine.errors import ConfigError
from higgs_stream.stream.codec_worker import CODEC_URGENT_S
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.serve_command import add_arguments, config_from_args


def test_defaults_are_production_safe():
    cfg = ServerConfig()
    assert (cfg.context_idle_s, cfg.http_body_timeout_s, cfg.idle_timeout_s, cfg.max_reference_s) == (60, 30, 300, 30)
    assert cfg.allowed_origins == () and cfg.ice_servers == ()  # same origin only; no public STUN server
    assert cfg.cors_origins == ()  # no CORS


@pytest.mark.parametrize("field, value, match", [
    ("context_idle_s", 0, "context_idle_s"),
    ("http_body_timeout_s", -1, "http_body_timeout_s"),
    ("max_reference_s", 0, "max_reference_s"),
    ("allowed_origins", ("https://app.example/",), "scheme://host"),
    ("allowed_origins", ("app.example",), "scheme://host"),
    ("allowed_origins", ("ftp://app.example",), "scheme://host"),
    ("allowed_origins", "https://app.example", "tuple"),
    ("cors_origins", ("*",), "CORS origin"),
    ("cors_origins", ("https://app.example/path",), "CORS origin"),
    ("cors_origins", "https://app.example", "tuple"),
    ("ice_servers", ("http://stun.example",), "stun:HOST"),
    ("ice_servers", ("turn:turn.example",), "TURN needs"),
    ("ice_servers", ("stun:u:p@stun.example",), "STUN takes none"),
    ("ice_servers", ("stun:stun.example?transport=tcp",), "only TURN"),
    ("codec_queue_rounds", 0, "codec_queue_rounds"),
    ("codec_queue_rounds", None, "codec_queue_rounds"),
    ("send_buffer_kib", 2, "send_buffer_kib"),
    ("send_buffer_kib", 1 << 20, "send_buffer_kib"),
    ("send_buffer_kib", 64.0, "send_buffer_kib"),
])
def test_invalid_limits_are_refused(field, value, match):
    with pytest.raises(ConfigError, match=match):
        ServerConfig(**{field: value})


def test_serve_flags_set_the_limits():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--model", "m", "--allow-origin", "https://app.example", "--allow-origin", "http://localhost:3000",
        "--cors-origin", "https://web.example", "--cors-origin", "http://localhost:5173",
        "--ice-server", "stun:stun.example:3478", "--ice-server", "turns:u:p@turn.example:5349?transport=tcp",
        "--idle-timeout", "100", "--context-idle-timeout", "20", "--http-body-timeout", "5", "--max-reference-s", "12",
    ])
    cfg = config_from_args(args)
    assert cfg.allowed_origins == ("https://app.example", "http://localhost:3000")
    assert cfg.cors_origins == ("https://web.example", "http://localhost:5173")
    assert cfg.ice_servers == ("stun:stun.example:3478", "turns:u:p@turn.example:5349?transport=tcp")
    assert (cfg.idle_timeout_s, cfg.context_idle_s, cfg.http_body_timeout_s, cfg.max_reference_s) == (100, 20, 5, 12)
    assert cfg.send_buffer_bytes == 128 * 1024  # the default
    for flag, kib in (("64", 64), ("0", None)):  # 0: the kernel's autotuning
        cfg = config_from_args(parser.parse_args(["--model", "m", "--send-buffer-kib", flag]))
        assert cfg.send_buffer_kib == kib
    for flag in ("-1", "3", "65537"):  # named as the flag, not as the config's field
        with pytest.raises(ConfigError, match=r"--send-buffer-kib .*4\.\.65536.*0 for the kernel"):
            config_from_args(parser.parse_args(["--model", "m", "--send-buffer-kib", flag]))
    with pytest.raises(ConfigError, match="origin"):
        config_from_args(parser.parse_args(["--model", "m", "--allow-origin", "evil"]))
    # serve's defaults are the library's, but for the warm-up utterance (serve only: embedded servers and
    # tests start without it)
    assert config_from_args(parser.parse_args(["--model", "m"])) == ServerConfig(token=args.token, warm_up=True)


def test_codec_schedule_is_eager_unless_asked():
    from higgs_stream.engine.errors import ConfigError
    from higgs_stream.stream.config import ServerConfig

    assert ServerConfig().codec_schedule == "eager"
    assert ServerConfig(codec_schedule="just_in_time").codec_schedule == "just_in_time"
    with pytest.raises(ConfigError, match="codec_schedule"):
        ServerConfig(codec_schedule="lazy")
    assert ServerConfig().codec_sms is None and ServerConfig(codec_sms=48).codec_sms == 48
    with pytest.raises(ConfigError, match="codec_sms"):
        ServerConfig(codec_sms=0)
    assert ServerConfig().gil_switch_s == 1e-3
    for bad in (0.0, 1.0):
        with pytest.raises(ConfigError, match="gil_switch_s"):
            ServerConfig(gil_switch_s=bad)
    with pytest.raises(ConfigError, match="codec_overdue_first"):
        ServerConfig(codec_sms=48, codec_overdue_first=True)
    assert ServerConfig(codec_overdue_first=True).codec_overdue_first and not ServerConfig().codec_overdue_first
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--ramp-repeat", "2", "--max-first-chunk", "12"])
    from higgs_stream.stream.serve_command import config_from_args

    cfg = config_from_args(args)
    assert cfg.ramp_repeat == 2 and cfg.max_first_chunk == 12
    assert config_from_args(parser.parse_args(["--model", "m", "--first-chunk-margin", "3"])).first_chunk_margin == 3.0
    assert config_from_args(parser.parse_args(["--model", "m"])).ramp_repeat == ServerConfig().ramp_repeat is None
    for bad in (0, 5, 1.5):
        with pytest.raises(ConfigError, match="ramp_repeat"):
            ServerConfig(ramp_repeat=bad)


def test_prefill_pack_is_checked_before_the_model_loads():
    """--prefill-pack (first chunks per prefill replay, CUDA): 1..32, a ConfigError on any device before
    the checkpoint is read (the CPU's reference runner does not use it)."""
    from higgs_stream.engine.errors import ConfigError
    from higgs_stream.engine.model_runner import MAX_PREFILL_PACK, ModelRunnerConfig
    from higgs_stream.stream.serve_command import build_state

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).prefill_pack == ModelRunnerConfig().prefill_pack == 8
    assert ModelRunnerConfig(prefill_pack=MAX_PREFILL_PACK).prefill_pack == 32
    for bad in ("0", "33"):
        with pytest.raises(ConfigError, match="prefill_pack must be in 1..32"):
            build_state(parser.parse_args(["--model", "/nonexistent", "--device", "cpu", "--prefill-pack", bad]))


def test_pdl_max_rows_is_parsed_and_checked_before_the_model_loads():
    """--pdl-max-rows N (CUDA decode graphs of at most N rows with programmatic dependent launch): default none given
    (the talker's: model_runner.default_pdl_max_rows), 0 turns it off, below 0 a ConfigError on any device before the
    checkpoint is read."""
    from higgs_stream.engine.errors import ConfigError
    from higgs_stream.engine.model_runner import ModelRunnerConfig, runner_config
    from higgs_stream.stream.serve_command import build_state

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).pdl_max_rows is None
    assert ModelRunnerConfig().pdl_max_rows is None and runner_config("fp8").pdl_max_rows is None
    assert runner_config("none", options={"pdl_max_rows": 0}).pdl_max_rows == 0
    assert parser.parse_args(["--model", "m", "--pdl-max-rows", "0"]).pdl_max_rows == 0
    with pytest.raises(ConfigError, match="pdl_max_rows must be >= 0"):
        build_state(parser.parse_args(["--model", "/nonexistent", "--device", "cpu", "--pdl-max-rows", "-1"]))


def test_fuse_rules_is_parsed_into_the_runner_options():
    """--fuse-rules / --no-fuse-rules (CUDA: the row rules compiled into fused kernels): on by default, as the
    runner's default; off reaches the runner's config."""
    from higgs_stream.engine.model_runner import ModelRunnerConfig, runner_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).fuse_rules is True is ModelRunnerConfig().fuse_rules
    assert parser.parse_args(["--model", "m", "--no-fuse-rules"]).fuse_rules is False
    assert runner_config("none", options={"fuse_rules": False}).fuse_rules is False


def test_triton_decode_from_is_parsed_and_checked_before_the_model_loads():
    """--triton-decode-from N|none (CUDA decode graphs of N rows and more on the Triton attention kernel): default
    the runner's, 'none' turns it off, a bad value is refused by argparse or, below 1, a ConfigError before the
    checkpoint is read."""
    from higgs_stream.engine.errors import ConfigError
    from higgs_stream.engine.model_runner import ModelRunnerConfig
    from higgs_stream.stream.serve_command import build_state

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).triton_decode_from == ModelRunnerConfig().triton_decode_from == 64
    assert parser.parse_args(["--model", "m", "--triton-decode-from", "None"]).triton_decode_from is None
    assert parser.parse_args(["--model", "m", "--triton-decode-from", "128"]).triton_decode_from == 128
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--triton-decode-from", "many"])
    with pytest.raises(ConfigError, match="triton_decode_from must be >= 1"):
        build_state(parser.parse_args(["--model", "/nonexistent", "--device", "cpu", "--triton-decode-from", "0"]))


def test_late_prompts_reach_the_engine_config():
    """--late-prompts / --no-late-prompts (on by default, as EngineConfig's) is the engine's `late_prompts`
    (a random tiny model on the CPU: the reference runner, which cannot take late prompts, runs classic
    steps)."""
    from higgs_stream.engine.engine import EngineConfig
    from higgs_stream.stream.serve_command import build_state

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).late_prompts is EngineConfig.late_prompts is True
    for flag, want in (("--late-prompts", True), ("--no-late-prompts", False)):
        args = parser.parse_args(["--model", "random:tiny", "--arch", "v3", "--device", "cpu", flag, "--no-warm-up"])
        engine = build_state(args).pipeline.engine
        assert engine.config.late_prompts is want and not engine.runner.late_prompts
    assert parser.parse_args(["--model", "m"]).late_prompts_in_bursts is EngineConfig.late_prompts_in_bursts
    for flag, want in (("--late-prompts-in-bursts", True), ("--no-late-prompts-in-bursts", False)):
        args = parser.parse_args(["--model", "random:tiny", "--arch", "v3", "--device", "cpu", flag, "--no-warm-up"])
        assert build_state(args).pipeline.engine.config.late_prompts_in_bursts is want


def test_codec_starting_ms_reaches_the_codec_worker_in_seconds():
    """--codec-starting-ms (the cap as a predicted call time) is checked by ServerConfig and reaches the worker, whose
    `starting` is the pipeline's own test (a stream waits for its first audio)."""
    from higgs_stream.engine.errors import ConfigError
    from higgs_stream.stream.serve_command import build_state

    assert ServerConfig().codec_starting_ms is None and ServerConfig(codec_starting_ms=12.5).codec_starting_ms == 12.5
    assert ServerConfig(codec_starting_ms=0).codec_starting_ms == 0  # 0: off (None: the family's)
    with pytest.raises(ConfigError, match="codec_starting_ms"):
        ServerConfig(codec_starting_ms=-3.0)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "random:tiny", "--device", "cpu", "--codec-starting-ms", "12",
                              "--no-warm-up"])
    pipeline = build_state(args).pipeline
    worker = pipeline.codec_worker
    assert worker.starting_s == pytest.approx(0.012) and worker.starting() is False
    assert worker.starting.__func__ is type(pipeline)._starting
    # --codec-starting-ahead extends the cap to listeners with little audio left: the worker asks the pipeline that
    pipeline = build_state(parser.parse_args(["--model", "random:tiny", "--device", "cpu", "--codec-starting-ms", "12",
                                              "--codec-starting-ahead", "0.3", "--no-warm-up"])).pipeline
    assert pipeline.cfg.codec_starting_ahead_s == 0.3
    assert pipeline.codec_worker.starting.__func__ is type(pipeline)._ramping
    for bad in (0, -1.0):
        with pytest.raises(ConfigError, match="codec_starting_ahead_s"):
            ServerConfig(codec_starting_ms=12, codec_starting_ahead_s=bad)
    with pytest.raises(ConfigError, match="set codec_starting_ms too"):  # v2 has no cap of its own to extend
        build_state(parser.parse_args(["--model", "random:tiny", "--device", "cpu", "--codec-starting-ahead", "0.3",
                                       "--no-warm-up"]))
    # --codec-starting-exempt narrows the cap's exemption from the urgent horizon (0.3 s) to S seconds
    assert pipeline.codec_worker.starting_exempt_s == CODEC_URGENT_S  # the default when the flag is absent
    pipeline = build_state(parser.parse_args(["--model", "random:tiny", "--device", "cpu", "--codec-starting-ms", "30",
                                              "--codec-starting-exempt", "0.1", "--no-warm-up"])).pipeline
    assert pipeline.codec_worker.starting_exempt_s == 0.1
    for bad in (-0.01, 0.31):
        with pytest.raises(ConfigError, match="codec_starting_exempt_s"):
            ServerConfig(codec_starting_ms=12, codec_starting_exempt_s=bad)
    with pytest.raises(ConfigError, match="set codec_starting_ms too"):
        build_state(parser.parse_args(["--model", "random:tiny", "--device", "cpu", "--codec-starting-exempt", "0.1",
                                       "--no-warm-up"]))



def test_gpu_headroom_is_parsed_checked_and_reaches_the_codec_worker():
    """--gpu-headroom-gb GB|none (engine/gpu_memory.py: the serving process's GPU memory bound): 16 GB by default,
    'none' turns the bound off, a bound of 0 or less is refused by the config and by the codec worker."""
    from higgs_stream.engine.gpu_memory import HEADROOM_GB
    from higgs_stream.stream.codec_worker import CodecWorker

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--model", "m"])).gpu_headroom_gb == HEADROOM_GB == 16.0
    assert config_from_args(parser.parse_args(["--model", "m", "--gpu-headroom-gb", "none"])).gpu_headroom_gb is None
    assert config_from_args(parser.parse_args(["--model", "m", "--gpu-headroom-gb", "24.5"])).gpu_headroom_gb == 24.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--gpu-headroom-gb", "lots"])
    with pytest.raises(ConfigError, match="gpu_headroom_gb must be > 0 or None"):
        config_from_args(parser.parse_args(["--model", "m", "--gpu-headroom-gb", "0"]))
    with pytest.raises(ConfigError, match="gpu_headroom_gb must be > 0 or None"):
        CodecWorker(object(), lambda sid: None, lambda items: None, memory_headroom_gb=-1.0)


def test_a_voice_alias_given_twice_is_refused():
    """`--voice-alias Nova=bob --voice-alias Nova=Alice`: the last one silently won (a probe)."""
    from higgs_stream.engine.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--voice-alias", "Nova=bob", "--voice-alias", "Nova=Alice"])
    with pytest.raises(ConfigError, match="--voice-alias 'Nova' given twice \\('bob', 'Alice'\\)"):
        config_from_args(args)
