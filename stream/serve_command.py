"""The `higgs-stream serve` command: its flags, the `ServerConfig` and `ServerState` they make (an engine, a codec,
the pipeline and the voices; Ray Serve's replicas build theirs here too: stream/ray_app.py), and
`run`, which serves them on the aiohttp app of stream/server.py or, with `--ray`, under Ray Serve."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from higgs_stream.engine.engine import EngineConfig
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.startup_checks import check_device, check_output_path
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.stream.config import ServerConfig, gb_or_none, rows_or_none
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.pacing import PacingConfig
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.stream.server import exit_on_signals, serve_until_signalled
from higgs_stream.stream.server_state import ServerState, listening_sockets
from higgs_stream.stream.voices import VoiceLibrary

__all__ = ["RAY_FLAGS", "add_arguments", "add_ray_arguments", "config_from_args", "build_state", "run"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    parser.add_argument("--model", required=True,
                        help="model directory or hub id (talker + tokenizer); random:tiny | random:full = random "
                             "weights built in memory, EOS suppressed (noise, for benchmarking: engine/random_weights.py)")
    parser.add_argument("--arch", choices=("v2", "v3"), default=None,
                        help="with --model random:*: the architecture to build (default v2); checkpoints name their own")
    parser.add_argument("--codec", default=None,
                        help="v2 codec directory or hub id (default: MODEL/audio_tokenizer, else bosonai/higgs-audio-v2-tokenizer; "
                             "v3 checkpoints carry their own)")
    parser.add_argument("--host", default=d.host, help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="port to listen on (default %(default)s)")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="talker dtype (default: bfloat16 on cuda, float32 on cpu); the codec is always float32")
    parser.add_argument("--voices", default=None, help="folder of voice presets: NAME.wav + NAME.txt")
    parser.add_argument("--voice-alias", action="append", default=[], metavar="ALIAS=PRESET",
                        help="map a voice name (e.g. an OpenAI name) to a preset; repeatable")
    parser.add_argument("--max-streams", type=int, default=d.max_streams)
    parser.add_argument("--max-frames", type=int, default=d.max_frames, help="frames per segment (25/s)")
    parser.add_argument("--mode", choices=("exact", "low_latency"), default=d.default_mode)
    parser.add_argument("--kv-pages", type=int, default=None, help="KV cache pages (engine default if unset)")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="debug: on cuda, run decode steps eagerly instead of replaying CUDA graphs")
    parser.add_argument("--codec-precision", choices=("exact", "tf32"), default="exact",
                        help="exact: fp32 convolutions, streamed audio equals the one-shot decode to fp32 rounding; "
                             "tf32 (CUDA, opt-in): cuDNN TF32 convolutions, faster, ~1e-3 of peak from exact "
                             "(docs/PERF.md). No bf16 mode: the decoder's ConvTranspose is unstable in bf16")
    parser.add_argument("--codec-gemm-max-rate-out", type=int, default=None, metavar="N",
                        help="Higgs codec on CUDA: the stateful decoder's stages up to N output samples a frame run "
                             "as fp32 GEMMs instead of cuDNN (default 40: up to 1 kHz, the fastest on an H200; 1: the "
                             "first conv alone; docs/PERF.md sessions 29-30)")
    parser.add_argument("--pause-ahead", type=float, default=d.pause_ahead_s, metavar="S",
                        help="GPU saturated: pause streams this far ahead of their listener (s)")
    parser.add_argument("--resume-ahead", type=float, default=d.resume_ahead_s, metavar="S",
                        help="... and resume them this close to it (s)")
    parser.add_argument("--yield-ahead", type=float, default=d.yield_ahead_s, metavar="S",
                        help=f"low load: while a stream waits for its first audio and at most "
                             f"{PacingConfig.yield_max_streams} others exist, those more than S seconds ahead of their "
                             "listener skip engine steps, and while every stream is that far ahead the engine steps "
                             "synchronously, so a newcomer's first frames run alone (default %(default)s; a negative "
                             "value is off)")
    parser.add_argument("--saturated-step-ratio", type=float, default=d.saturated_step_ratio, metavar="R",
                        help="the GPU counts as saturated (pausing streams far ahead is on) while an engine step "
                             "takes more than R x one frame (default %(default)s)")
    parser.add_argument("--codec-max-windows", type=int, default=d.codec_max_windows, metavar="N",
                        help="streams one codec call decodes at most, once the codec has fallen behind (default "
                             "%(default)s; the warm-up graphs calls up to N streams)")
    parser.add_argument("--codec-calm-windows", type=int, default=d.codec_calm_windows, metavar="N",
                        help="streams one codec call decodes while the codec keeps up: it holds at most one full call "
                             "of --codec-max-windows streams' steady chunks (default: the family's, 32 for Higgs "
                             "v2/v3, 64 for Qwen3-TTS): fewer makes the longest call shorter (a first chunk waits for "
                             "the call in flight) and the codec less efficient (H200, v2, 128 streams: TTFA p95 "
                             "218-280 ms at 32, 273-378 at 64; docs/PERF.md)")
    parser.add_argument("--codec-schedule", choices=("eager", "just_in_time"), default=d.codec_schedule,
                        help="eager: decode audio as the talker makes it (batched over 50 ms); just_in_time: while "
                             "streams are starting, decode each stream's audio only when its listener needs it within "
                             "1 s (less codec work beside the talker; thinner client buffers). Default %(default)s")
    parser.add_argument("--codec-sms", type=int, default=None, metavar="N",
                        help="CUDA: run the codec on a green context of N SMs (Hopper: a multiple of 8) so its "
                             "convolutions never take every SM from the talker; default: every SM (measured "
                             "better on an H100 than 48 or 32: docs/PERF.md)")
    parser.add_argument("--gil-switch-ms", type=float, default=d.gil_switch_s * 1e3, metavar="MS",
                        help="the serving process's GIL switch interval (default %(default)s ms): how long the engine "
                             "thread waits for the GIL behind the event loop's or the codec thread's Python each time "
                             "one of its calls drops it (a dozen or more times per engine step; docs/PERF.md)")
    parser.add_argument("--gpu-headroom-gb", type=gb_or_none, default=d.gpu_headroom_gb, metavar="GB|none",
                        help="CUDA: once the codec has warmed up (convolution plans picked with 8 GB free, graphs "
                             "captured with 48), cap this process's GPU memory at what it holds plus GB (default "
                             "%(default)s): a cuDNN plan that took ~80 GB of workspace on an idle H200 decoded audio "
                             "wrong (engine/gpu_memory.py); work beyond the cap fails its request. 'none': no bounds")
    parser.add_argument("--codec-overdue-first", action="store_true",
                        help="CUDA: a codec call that holds an overdue job (a stream's first chunk, a listener already "
                             "dry) runs on a CUDA stream above the talker's priority, so its kernels go first beside a "
                             "running talker step (default off: the talker's kernels go first; docs/PERF.md)")
    parser.add_argument("--prefill-pack", type=int, default=ModelRunnerConfig.prefill_pack, metavar="N",
                        help="CUDA: prefill up to N arriving prompts in one forward (a burst of arrivals reads the "
                             "weights once per N prompts; default %(default)s); 1: one prompt per forward, so a "
                             "stream's codes never depend on what else runs (batch-invariant, slower bursts)")
    parser.add_argument("--triton-decode-from", type=rows_or_none, default=ModelRunnerConfig.triton_decode_from,
                        metavar="N|none",
                        help="CUDA: decode steps of N or more rows attend with our Triton kernel over whole sequences, "
                             "fewer with its ranged form (fixed 64-token ranges, then a merge: a stream's codes do not "
                             "depend on its batch) (default %(default)s; 'none': FlashInfer's decode always). H100, v2, "
                             "per layer: 256 rows 112 vs 130 us over bf16 pages (docs/PERF.md)")
    parser.add_argument("--triton-ranged-decode", action=argparse.BooleanOptionalAction,
                        default=ModelRunnerConfig.triton_ranged_decode,
                        help="CUDA: steps below --triton-decode-from run the Triton kernel's ranged form "
                             "(--no-triton-ranged-decode: FlashInfer's CUDA-core decode there)")
    parser.add_argument("--pdl-max-rows", type=int, default=None, metavar="N",
                        help="CUDA 9.0+: decode steps of at most N rows launch their Triton kernels with programmatic "
                             "dependent launch (each starts as the one before ends; the same codes) (default: 32 for "
                             "bf16 Higgs talkers, 2 quantized, 0 for Qwen3-TTS; 0: never). H200, v2, one row: 1.62 vs "
                             "1.77 ms fp8, 2.45 vs 2.52 bf16 (docs/PERF.md)")
    parser.add_argument("--fuse-rules", action=argparse.BooleanOptionalAction, default=ModelRunnerConfig.fuse_rules,
                        help="CUDA: the Higgs families' row rules (ramps, RAS, the frame cap) compiled by torch.compile "
                             "into a few fused kernels at start-up (the same codes). H200, v2: the step's sampling tail "
                             "188 -> 64 us at one row; the compiles add ~20 s to a start on an empty Inductor cache")
    parser.add_argument("--bf16-gemv-rows", type=int, default=ModelRunnerConfig.bf16_gemv_rows, metavar="N",
                        help="CUDA: plain bf16 linears of at most N rows (<= 4) run on our CUDA-core GEMV where, timed "
                             "at start-up per weight shape, it beats cuBLAS by 15 %% or more (default %(default)s; 0: "
                             "never). H200, Qwen3-TTS's code predictor's o projection: 12.9 -> 5.6 us at one row")
    parser.add_argument("--max-first-chunk", type=int, default=d.max_first_chunk, metavar="FRAMES",
                        help="exact mode (and low-latency): under load the first chunk grows (it must outlast the "
                             "engine steps and the longest codec call before chunk 1), up to this many frames (default: "
                             "the family's, 10 for Higgs v2/v3, 8 for Qwen3-TTS; each frame adds one engine step of TTFA)")
    parser.add_argument("--first-chunk-margin", type=float, default=d.first_chunk_margin, metavar="K",
                        help="exact mode (and low-latency under load): size the first chunk for K x the longest recent "
                             "codec call (default: the family's, 3 for Higgs v2/v3, 1 for Qwen3-TTS; in 256-stream "
                             "bursts the calls during a first chunk ran 2-4x any recent one: docs/PERF.md; never above "
                             "--max-first-chunk)")
    parser.add_argument("--ramp-repeat", type=int, default=d.ramp_repeat, metavar="N",
                        help="exact mode (and low-latency under load): the first N chunks have the first chunk's size "
                             "before the schedule doubles (default: the family's, 2 for Higgs v2/v3, 1 for Qwen3-TTS; "
                             "1: 1, 2, 4, ... x the first; 2: chunk 1 needs as many frames as chunk 0, so it leaves "
                             "one first-chunk's worth of steps "
                             "sooner; the first chunk is sized for it)")
    parser.add_argument("--codec-queue-rounds", type=int, default=d.codec_queue_rounds, metavar="N",
                        help="rounds of decode work (one per engine step that made some) queued for the codec thread "
                             "before the engine thread waits for it: while one codec call runs, the talker makes N "
                             "steps, then stops until the call ends (default 4; H200, v2, 256 streams over 2 s: TTFA p95 "
                             "385-454 ms at 4 vs 451-837 at 8, unbounded worse; Qwen3-TTS at 20 req/s the same at 2, 4 "
                             "and 8: docs/PERF.md)")
    parser.add_argument("--codec-starting-ms", type=float, default=d.codec_starting_ms, metavar="MS",
                        help="a codec call taken while a stream waits for its first audio holds its urgent jobs (due "
                             "within 0.3 s) and then as many frames as the codec's measured call time (a fixed cost plus "
                             "a cost per frame, fitted on its recent calls) keeps within MS, so a first chunk rarely "
                             "queues behind a long call; one cap for codecs of any frame cost; 0: off (default: the "
                             "family's: Qwen3-TTS 12 with --codec-starting-ahead 0.2, H100 20 req/s TTFA p95 61-63 vs 76 "
                             "ms without; Higgs v2/v3 off, no gain at 256 streams; docs/PERF.md)")
    parser.add_argument("--codec-starting-exempt", type=float, default=d.codec_starting_exempt_s, metavar="S",
                        help="with --codec-starting-ms: a capped call still takes every job due within S seconds (default "
                             "0.3, the codec's urgent horizon); shorter cuts a burst's calls in deadline order too, the "
                             "later jobs going in the next call (at 256 streams arriving over 2 s nearly every job is "
                             "due within 0.3 s, so the cap held no call there: docs/PERF.md)")
    parser.add_argument("--codec-starting-ahead", type=float, default=d.codec_starting_ahead_s, metavar="S",
                        help="with --codec-starting-ms: the cap also holds while some listener has less than S seconds "
                             "of audio (a stream's first chunks; the 256-stream bursts' stalls came there, behind "
                             "calls of the backlog 2-4x longer than any before: docs/PERF.md) (default: the family's "
                             "with the family's cap, Qwen3-TTS 0.2; else only while a stream waits for its first audio)")
    parser.add_argument("--late-prompts", action=argparse.BooleanOptionalAction, default=EngineConfig.late_prompts,
                        help="CUDA: a prompt that arrives while a talker step runs is prefilled in a launch of "
                             "its own right behind it instead of riding the next step beside every stream's decode, so "
                             "its first frame comes one decode step sooner (default on: H100, 20 req/s, TTFA p95 73 vs "
                             "97 ms; docs/PERF.md); for families that sample at the prompt's end (Qwen3-TTS, Higgs "
                             "v3); Higgs v2 folds its first decode token into the prompt's step and runs classic steps")
    parser.add_argument("--late-prompts-in-bursts", action=argparse.BooleanOptionalAction,
                        default=EngineConfig.late_prompts_in_bursts,
                        help="late prompts also while the newest regular step carries prompt chunks (arrivals faster "
                             "than one a step); off (default): those prompts ride the next regular step, packed (H100, "
                             "v3, 256 streams arriving over 2 s: 0 of 418 streams underran vs 3 of 331; docs/PERF.md)")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="diagnostics: leave start-up's objects in Python's garbage collection (each full "
                             "collection then walks them all while every thread of the server waits)")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="report healthy without first running one utterance through the pipeline (the "
                             "first client then pays for kernel compilation and autotuning)")
    parser.add_argument("--admit-step-ratio", type=float, default=d.admit_step_ratio, metavar="R",
                        help="refuse new streams (busy) when the predicted engine step exceeds R x one frame "
                             "(40 ms); 0 = no admission by load (only --max-streams)")
    parser.add_argument("--quantize", choices=("none", "fp8", "int8"), default="none",
                        help="backbone linears at load: fp8 (W8A8, CUDA compute capability >= 8.9) or int8 "
                             "(weight-only, any device); embeddings, heads, norms and the codec stay as loaded")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="K/V pages in the model dtype (auto) or fp8 e4m3: --kv-pages then take half of "
                             "bf16's memory")
    parser.add_argument("--profile-out", default=None, metavar="FILE",
                        help="diagnostics: sample every thread's Python stack (event loop, engine, codec) every 2 ms "
                             "and write the profile there as JSON at shutdown (scripts/top_samples.py reads it)")
    parser.add_argument("--trace-out", default=None, metavar="FILE",
                        help="diagnostics: record every engine step, codec call and stream's first audio, written as "
                             "JSON to FILE at shutdown (scripts/ttfa_breakdown.py reads it); held in memory until "
                             "then (~100 bytes a step): for benchmark runs, not for a long-lived server")
    parser.add_argument("--kernels", choices=("fast", "ref"), default="fast",
                        help="debug: on cuda, 'ref' runs the plain-torch kernels (no Triton/FlashInfer, no graphs)")
    parser.add_argument("--token", default=os.environ.get("HIGGS_STREAM_TOKEN"),
                        help="require this bearer token (default: $HIGGS_STREAM_TOKEN; unset = no auth)")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="a browser origin (scheme://host[:port]) allowed besides the server's own; '*' = any; "
                             "repeatable. Requests without an Origin header are always allowed")
    parser.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                        help="a web app origin (scheme://host[:port]) whose pages may call /v1/audio/speech and "
                             "/v1/voices (CORS) and open the WebSocket; repeatable (default: none, no CORS)")
    parser.add_argument("--ice-server", action="append", default=[], metavar="URL",
                        help="WebRTC ICE server: stun:HOST[:PORT] or turn[s]:USER:CREDENTIAL@HOST[:PORT]"
                             "[?transport=udp|tcp]; repeatable (default: none, host candidates only)")
    parser.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s, metavar="S",
                        help="close a connection with no open context and no message for S seconds")
    parser.add_argument("--drain-timeout", type=float, default=d.drain_s, metavar="S",
                        help="at shutdown (SIGTERM / SIGINT; a second one ends the drain at once) new streams are refused "
                             "(shutting_down, HTTP 503) while the open ones (still read: their end, cancel) run to their end for up to S seconds; the "
                             "rest then end with error{shutting_down}. Under Ray Serve: graceful_shutdown_timeout_s. "
                             "Keep it below the platform's kill grace (Kubernetes: 30 s by default)")
    parser.add_argument("--context-idle-timeout", type=float, default=d.context_idle_s, metavar="S",
                        help="end an open context (no `end` yet) with no message and no audio for S seconds")
    parser.add_argument("--http-body-timeout", type=float, default=d.http_body_timeout_s, metavar="S",
                        help="answer 408 when an HTTP request body has not arrived within S seconds")
    parser.add_argument("--max-reference-s", type=float, default=d.max_reference_s, metavar="S",
                        help="longest reference audio, checked from the file header before decoding")
    parser.add_argument("--send-buffer-kib", type=int, default=d.send_buffer_kib, metavar="KIB",
                        help="each client connection's kernel send buffer, 4..65536 (SO_SNDBUF; Linux doubles it and "
                             "caps it at net.core.wmem_max): what a client that stopped reading can have queued "
                             "before its context pauses; 0: the kernel's autotuning (up to 4 MiB, ~85 s of audio)")
    parser.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes, metavar="N",
                        help="largest WebSocket message / HTTP body (too_large); twice this closes the socket (1009)")
    add_ray_arguments(parser)


# Ray Serve (stream/ray_app.py): `serve --ray` and these flags; the replicas get the others.
RAY_FLAGS = ("ray", "ray_address", "replicas", "max_replicas", "gpus_per_replica", "cpus_per_replica",
             "max_queued")


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Ray Serve (--ray)", "many GPUs and hosts behind one endpoint (README, Scale-out); "
                                  "needs the `ray` extra: pip install 'higgs-stream[ray]'")
    g.add_argument("--ray", action="store_true",
                   help="run under Ray Serve, one replica per GPU (--host/--port: Serve's proxy)")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, a running local one, else start one here)")
    g.add_argument("--replicas", type=int, default=None, help="replicas (default: one per GPU of the cluster, else 1)")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale from --replicas up to this many on ongoing streams (target 0.7 x --max-streams "
                        "per replica)")
    g.add_argument("--gpus-per-replica", type=float, default=None, help="default: 1 when the cluster has GPUs, else 0")
    g.add_argument("--cpus-per-replica", type=float, default=1.0)
    g.add_argument("--max-queued", type=int, default=64,
                   help="requests that may wait at each proxy for a replica (a free stream slot, or just their "
                        "assignment during a burst); beyond them, 503 busy at once")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of `higgs-stream serve`'s flags (ConfigError when one is invalid)."""
    if args.send_buffer_kib != 0 and not 4 <= args.send_buffer_kib <= 65536:
        raise ConfigError(f"--send-buffer-kib {args.send_buffer_kib}: expected 4..65536 (KiB), or 0 for the kernel's "
                          "autotuning")
    aliases = {}
    for item in args.voice_alias:
        alias, sep, target = item.partition("=")
        if not sep:
            raise ConfigError(f"--voice-alias {item!r}: expected ALIAS=PRESET")
        if alias in aliases:  # the last one silently won (a probe); names differing by case: VoiceLibrary refuses
            raise ConfigError(f"--voice-alias {alias!r} given twice ({aliases[alias]!r}, {target!r})")
        aliases[alias] = target
    return ServerConfig(host=args.host, port=args.port, token=args.token, max_streams=args.max_streams,
                        max_frames=args.max_frames, default_mode=args.mode, voices_dir=args.voices,
                        voice_aliases=aliases, allowed_origins=tuple(args.allow_origin),
                        cors_origins=tuple(args.cors_origin),
                        ice_servers=tuple(args.ice_server), idle_timeout_s=args.idle_timeout,
                        drain_s=args.drain_timeout,
                        context_idle_s=args.context_idle_timeout, http_body_timeout_s=args.http_body_timeout,
                        max_reference_s=args.max_reference_s, max_message_bytes=args.max_message_bytes,
                        send_buffer_kib=args.send_buffer_kib or None,
                        pause_ahead_s=args.pause_ahead, resume_ahead_s=args.resume_ahead,
                        admit_step_ratio=args.admit_step_ratio or None,
                        codec_schedule=args.codec_schedule, codec_sms=args.codec_sms, warm_up=not args.no_warm_up,
                        codec_overdue_first=args.codec_overdue_first, gil_switch_s=args.gil_switch_ms / 1e3,
                        gpu_headroom_gb=args.gpu_headroom_gb,
                        codec_starting_ms=args.codec_starting_ms, codec_starting_ahead_s=args.codec_starting_ahead,
                        codec_starting_exempt_s=args.codec_starting_exempt, codec_queue_rounds=args.codec_queue_rounds,
                        ramp_repeat=args.ramp_repeat, max_first_chunk=args.max_first_chunk,
                        codec_max_windows=args.codec_max_windows, codec_calm_windows=args.codec_calm_windows,
                        first_chunk_margin=args.first_chunk_margin,
                        saturated_step_ratio=args.saturated_step_ratio,
                        yield_ahead_s=None if args.yield_ahead is None or args.yield_ahead < 0 else args.yield_ahead,
                        gc_freeze=not args.no_gc_freeze)


def check_listen(host: str, port: int) -> None:
    """ConfigError unless `host:port` can be listened on, checked before the model loads (a taken port or an
    unknown host was a traceback once the model had loaded, a probe): the server's own binds, closed again. A port
    taken between this and the server's bind still fails there (`run`)."""
    import socket

    try:
        socks = listening_sockets(host, port, None)
    except (socket.gaierror, UnicodeError, OverflowError) as e:
        raise ConfigError(f"--host {host!r} --port {port}: cannot listen there ({e})") from e
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    for sock in socks:
        sock.close()


def check_kv_pages(engine, max_frames: int) -> None:
    """ConfigError when the KV cache cannot hold even one stream of `max_frames` frames (before its prompt): every
    request would be refused `busy` with Retry-After, forever (`--kv-pages 1`, a probe)."""
    sched = engine.scheduler.config
    need = sched.pages_for(max_frames + engine.cfg.num_codebooks + engine.runner.kv_slack)
    if need > sched.num_pages:
        raise ConfigError(f"the KV cache has {sched.num_pages} pages; one stream of --max-frames {max_frames} needs at "
                          f"least {need} (raise --kv-pages, or lower --max-frames)")


def build_state(args: argparse.Namespace) -> ServerState:
    import torch
    from higgs_stream.engine.checkpoint_files import resolve_model_dir
    from higgs_stream.engine.engine import load_engine
    from higgs_stream.engine.models.registry import load_codec_for

    check_device(args.device)
    cfg = config_from_args(args)
    voices = VoiceLibrary.from_config(cfg)  # a bad voices folder fails before the model loads
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if str(args.device).startswith("cuda")
                                                            else torch.float32)
    if args.kv_pages is not None and args.kv_pages < 1:  # 0 once meant "the default"
        raise ConfigError(f"--kv-pages must be at least 1, got {args.kv_pages}")
    if cfg.max_streams > EngineConfig.token_budget:  # every stream's decode row is a token of one forward
        raise ConfigError(f"--max-streams {cfg.max_streams}: at most {EngineConfig.token_budget} (the tokens one engine "
                          "forward takes)")
    engine_cfg = EngineConfig(max_batch=max(64, cfg.max_streams), kv_cache_dtype=args.kv_cache_dtype,
                              late_prompts=args.late_prompts, late_prompts_in_bursts=args.late_prompts_in_bursts,
                              **({"kv_pages": args.kv_pages} if args.kv_pages is not None else {}))
    runner_options = {"prefill_pack": args.prefill_pack, "triton_decode_from": args.triton_decode_from,
                      "triton_ranged_decode": args.triton_ranged_decode, "bf16_gemv_rows": args.bf16_gemv_rows,
                      "fuse_rules": args.fuse_rules,
                      **({} if args.pdl_max_rows is None else {"pdl_max_rows": args.pdl_max_rows})}
    ModelRunnerConfig(**runner_options)  # a bad --prefill-pack / --triton-decode-from / --pdl-max-rows / .. fails here
    if args.codec_gemm_max_rate_out is not None and args.codec_gemm_max_rate_out < 1:  # before the model loads too
        raise ConfigError(f"--codec-gemm-max-rate-out must be >= 1, got {args.codec_gemm_max_rate_out}")
    engine_args = {"device": args.device, "dtype": dtype, "config": engine_cfg,
                   "cuda_graphs": not args.no_cuda_graphs, "kernels": args.kernels, "quantize": args.quantize,
                   "runner_options": runner_options}
    if args.model.startswith("random:"):  # benchmarking only: random weights, every utterance --max-frames long
        from higgs_stream.engine.random_weights import build_random

        if args.codec is not None:
            raise ConfigError(f"--codec does not apply to --model {args.model} (it builds its own random codec)")
        engine, codec = build_random(args.model, arch=args.arch or "v2", **engine_args)
    else:
        if args.arch is not None:
            raise ConfigError("--arch applies to --model random:* only; a checkpoint's config.json names its architecture")
        model_dir = resolve_model_dir(args.model)
        # cuda: the fast path (ModelRunner, CUDA graphs unless --no-cuda-graphs); cpu: the plain-torch RefRunner
        engine = load_engine(str(model_dir), **engine_args)
        codec = load_codec_for(model_dir, args.codec, device=args.device)  # v3: the codec bundled in the checkpoint
    if args.codec_precision == "tf32":
        codec.allow_tf32 = True
        log.warning("--codec-precision tf32: streamed audio is NOT the exact one-shot decode (about 1e-3 of peak "
                    "off, docs/PERF.md); the default 'exact' mode is")
    if args.codec_gemm_max_rate_out is not None:
        if not hasattr(codec, "gemm_max_rate_out"):
            raise ConfigError("--codec-gemm-max-rate-out applies to the Higgs codec (v2, v3) only")
        codec.gemm_max_rate_out = args.codec_gemm_max_rate_out
    check_kv_pages(engine, cfg.max_frames)
    if engine.policy.speakers:  # the model's built-in voices join the presets
        voices = VoiceLibrary.from_config(cfg, speakers=engine.policy.speakers)
    voices.check_transcripts(engine.check_transcript)  # a control token in a preset's transcript: now, not per request
    metrics_ = Metrics()
    return ServerState(cfg, Pipeline(engine, codec, cfg, metrics_), voices, metrics_)


def run(args: argparse.Namespace) -> int:
    if args.ray:
        try:
            from higgs_stream.stream import ray_app
        except ImportError as e:
            raise ConfigError(f"--ray needs Ray Serve ({e}): pip install 'higgs-stream[ray]'") from e
        return ray_app.run(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_listen(args.host, args.port)
    check_output_path("--trace-out", args.trace_out)
    check_output_path("--profile-out", args.profile_out)
    exit_on_signals()  # Ctrl-C while the model loads: one line and out, not a traceback
    state = build_state(args)
    asyncio.run(serve_until_signalled(state, args.host, args.port, args.trace_out, args.profile_out))
    return 0
