"""The aiohttp app on one port: WebSocket streaming, health, metrics, voices, the demo, and the
routes of stream/http_speech.py and stream/webrtc.py; the `higgs-stream serve` command.

Transports are thin drivers over the sans-I/O `Session` (stream/session.py) and the `Pipeline`
(stream/pipeline.py); every request passes the checks of stream/guards.py first. Every stream
handler watches its peer while it writes (the WebSocket runs a reader task beside its writer; HTTP
handlers are cancelled by aiohttp when the connection drops, which needs
`handler_cancellation=True`, as `serve()` sets), and every stream it opens is cancelled in
`finally`, so a dropped client frees its engine pages within one step.
Every accepted context ends with `done` or `error`: a failing message fails alone, a context left
open and idle times out, and should the session itself fail, its contexts end with `internal`
and the socket closes with 1011. Wire format: stream/PROTOCOL.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path

from aiohttp import WSCloseCode, WSMsgType, web
from higgs_stream.engine.errors import ConfigError, HiggsStreamError
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.errors import ForbiddenOriginError, IdleTimeoutError
from higgs_stream.stream.guards import (
    CORS_ROUTES,
    add_cors_headers,
    authorized,
    check_origin,
    check_request,
    cors_preflight,
    error_response,
    json_errors,
)
from higgs_stream.stream.http_speech import speech
from higgs_stream.stream.metrics import Metrics
from higgs_stream.stream.handle import Audio, StreamHandle
from higgs_stream.stream.pipeline import Pipeline
from higgs_stream.stream.server_state import STATE, ServerState
from higgs_stream.stream.session import Cancel, Close, Command, Open, Session, Speak
from higgs_stream.stream.voices import VoiceLibrary

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- transport-neutral session driver

class SessionRunner:
    """Runs the WebSocket protocol (PROTOCOL.md §1) over any message channel.

    `send_text(str)` / `send_bytes(bytes)` deliver to the peer; `receive()` returns the next
    client message (str or bytes) or None once the peer has gone. A reader task and a writer
    task run side by side; whichever ends first ends the session and cancels every open stream.
    """

    def __init__(self, state: ServerState, send_text: Callable[[str], Awaitable], send_bytes: Callable[[bytes], Awaitable],
                 query: dict[str, str] | None = None, transport: str = "ws"):
        self.state = state
        self.transport = transport  # metrics label
        self._send_text, self._send_bytes = send_text, send_bytes
        self.session = Session(state.config, state.voices, query, on_error=self._count_error)
        self.handles: dict[str, StreamHandle] = {}
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def _count_error(self, code: str) -> None:
        self.state.metrics.errors.inc(code=code)

    async def run(self, receive: Callable[[], Awaitable[str | bytes | None]]) -> None:
        """Until the peer goes or the session fails. A failure (a server bug) ends every live context
        with `error{internal}` + `done` (sent as far as the channel still takes them), then raises."""
        reader = asyncio.create_task(self._read(receive), name="session-reader")
        writer = asyncio.create_task(self._write(), name="session-writer")
        failure = None
        try:
            await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reader, writer):
                task.cancel()
            results = await asyncio.gather(reader, writer, return_exceptions=True)
            for handle in self.handles.values():
                handle.cancel()
            self.handles.clear()
            failure = next((r for r in results if isinstance(r, BaseException)
                            and not isinstance(r, (ConnectionError, asyncio.CancelledError))), None)
            if failure is not None:
                self.session.fail_all(HiggsStreamError("internal error: the session failed"))
                await self._flush_quietly()
        if failure is not None:
            raise failure

    async def _flush_quietly(self) -> None:
        try:
            async with asyncio.timeout(1.0):
                await self._flush()
        except Exception as e:  # noqa: BLE001 -- the channel is failing too; the transport closes it next
            log.info("could not send the final errors: %r", e)

    async def _read(self, receive) -> None:
        idle_s = self.state.config.idle_timeout_s
        while True:
            try:  # the idle clock runs only while no context is open (audio may take long to finish)
                message = await (receive() if self.handles else asyncio.wait_for(receive(), idle_s))
            except TimeoutError:
                self._count_error(IdleTimeoutError.code)
                await self._send_text(json.dumps({"type": "error", "code": IdleTimeoutError.code,
                                                  "message": f"no message and no open context for {idle_s:g} s"}))
                return
            if message is None:
                return
            self._execute(self.session.receive(message, self._loop.time()))
            self._wake.set()

    def _execute(self, commands: list[Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, Open):
                try:
                    handle = self.state.pipeline.open(cmd.options, transport=self.transport, stream_id=cmd.context_id)
                except Exception as e:
                    if not isinstance(e, HiggsStreamError):
                        log.exception("opening context %r failed", cmd.context_id)
                        e = HiggsStreamError(f"internal error: {type(e).__name__}")
                    self.session.reject(cmd.context_id, e)
                    continue
                handle.set_waker(self._wake.set)
                self.handles[cmd.context_id] = handle
                continue
            handle = self.handles.get(cmd.context_id)
            if handle is None:
                continue  # its Open was rejected
            if isinstance(cmd, Speak):
                handle.say(cmd.text)
            elif isinstance(cmd, Close):
                handle.close()
            elif isinstance(cmd, Cancel):
                del self.handles[cmd.context_id]
                handle.cancel()

    async def _write(self) -> None:
        max_bytes = self.state.config.max_send_bytes
        while True:
            self._wake.clear()
            now = self._loop.time()
            self._execute(self.session.tick(now))
            self._time_out_idle(now)
            await self._flush()
            head = self.session.head
            if head is not None:
                handle = self.handles[head]
                events = handle.take(max_bytes, first_alone=not self.session.audio_started(head))
                if events:
                    self.session.touch(head, self._loop.time())
                    for ev in events:
                        if isinstance(ev, Audio):
                            self.session.audio(head, ev.pcm)
                        else:
                            del self.handles[head]
                            self.session.finished(head, ev.reason, ev.error)
                    continue
            deadline = self.session.deadline()
            timeout = None if deadline is None else max(0.0, deadline - self._loop.time())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    def _time_out_idle(self, now: float) -> None:
        """End the open contexts that neither the client nor the pipeline touched for `context_idle_s`."""
        for cid in self.session.idle(now):
            handle = self.handles.get(cid)
            if handle is not None and (handle.busy or now - handle.active_at < self.state.config.context_idle_s):
                self.session.touch(cid, now if handle.busy else handle.active_at)
                continue
            self._execute(self.session.time_out(cid))

    async def _flush(self) -> None:
        for frame in self.session.outgoing():
            if isinstance(frame, bytes):
                await self._send_bytes(frame)
            else:
                await self._send_text(frame)


# ---------------------------------------------------------------- handlers

async def ws_stream(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    cfg = state.config
    try:
        check_origin(request, cfg)  # cross-site WebSocket hijacking: no upgrade
    except ForbiddenOriginError as e:
        return error_response(e, state.metrics)
    ws = web.WebSocketResponse(heartbeat=cfg.heartbeat_s, max_msg_size=cfg.hard_message_bytes, compress=False)
    await ws.prepare(request)
    state.sockets.add(ws)
    state.metrics.connections.inc()
    try:
        if not authorized(request, cfg.token):
            state.metrics.errors.inc(code="unauthorized")
            await ws.send_str(json.dumps({"type": "error", "code": "unauthorized", "message": "wrong or missing token"}))
            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"unauthorized")
            return ws

        async def receive() -> str | bytes | None:
            msg = await ws.receive()
            if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                return msg.data
            if msg.type == WSMsgType.ERROR:
                log.info("websocket closed with an error: %s", ws.exception())
            return None  # CLOSE / CLOSING / CLOSED / ERROR

        query = {k: v for k, v in request.query.items()}
        runner = SessionRunner(state, ws.send_str, ws.send_bytes, query)
        try:
            await runner.run(receive)
        except Exception:
            log.exception("websocket session failed")
            await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")
    finally:
        state.metrics.connections.dec()
        state.sockets.discard(ws)
        if not ws.closed:
            await ws.close()
    return ws


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    p = state.pipeline
    body = {"status": "ok" if p.healthy else "unhealthy", "active_streams": p.active,
            "max_streams": state.config.max_streams, "steps": p.steps}
    return web.json_response(body, status=200 if p.healthy else 503)


async def metrics(request: web.Request) -> web.Response:
    text = request.app[STATE].metrics.render()
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def voices(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        check_request(request, state.config)
    except HiggsStreamError as e:
        return error_response(e, state.metrics)
    return web.json_response(state.voices.describe())


def web_dir() -> Path | None:
    """The browser demo's folder inside the installed `higgs_stream.clients` package (if present)."""
    folder = Path(str(resources.files("higgs_stream.clients") / "web"))
    return folder if (folder / "index.html").is_file() else None


# ---------------------------------------------------------------- app

def make_app(state: ServerState) -> web.Application:
    """The app on one port. Run it with `handler_cancellation=True` (see `serve`)."""
    app = web.Application(client_max_size=state.config.hard_message_bytes, middlewares=[json_errors])
    app[STATE] = state
    app.router.add_get("/v1/tts/stream", ws_stream)
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_get("/v1/voices", voices)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    for path in CORS_ROUTES:
        app.router.add_route("OPTIONS", path, cors_preflight)
    app.on_response_prepare.append(add_cors_headers)
    _mount_webrtc(app, state)
    folder = web_dir()
    if folder is not None:
        # One route per file of the (flat) demo folder, so any other path is the JSON 404 of
        # `json_errors` (aiohttp's static route answers a missing file with an empty 404 itself).
        def serve_file(path):
            async def handler(request: web.Request) -> web.FileResponse:
                return web.FileResponse(path)
            return handler

        app.router.add_get("/", serve_file(folder / "index.html"))
        if (folder / "favicon.svg").is_file():  # browsers ask for /favicon.ico whatever the page says
            app.router.add_get("/favicon.ico", serve_file(folder / "favicon.svg"))
        for path in sorted(folder.iterdir()):
            if path.is_file() and not path.is_symlink():
                app.router.add_get(f"/{path.name}", serve_file(path))
    else:
        log.warning("no browser demo found (higgs_stream.clients/web/index.html); GET / is not served")

    async def start(app: web.Application) -> None:
        await state.pipeline.start()

    async def stop(app: web.Application) -> None:
        for ws in list(state.sockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutdown")
        await state.pipeline.stop()

    app.on_startup.append(start)
    app.on_shutdown.append(stop)
    return app


def _mount_webrtc(app: web.Application, state: ServerState) -> None:
    try:
        from higgs_stream.stream import webrtc
    except ImportError as e:  # aiortc/av are an optional extra
        log.info("WebRTC disabled (%s); install higgs-stream[webrtc] for POST /v1/webrtc/offer", e)
        return
    add_routes = getattr(webrtc, "add_routes", None)
    if add_routes is None:
        log.warning("higgs_stream.stream.webrtc has no add_routes(app, state); WebRTC not mounted")
        return
    add_routes(app, state)


async def serve(state: ServerState, host: str, port: int) -> web.AppRunner:
    """Start the app (returns the runner; `await runner.cleanup()` stops it). Port 0 = any free port."""
    runner = web.AppRunner(make_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


# ---------------------------------------------------------------- CLI: higgs-stream serve

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
    parser.add_argument("--pause-ahead", type=float, default=d.pause_ahead_s, metavar="S",
                        help="GPU saturated: pause streams this far ahead of their listener (s)")
    parser.add_argument("--resume-ahead", type=float, default=d.resume_ahead_s, metavar="S",
                        help="... and resume them this close to it (s)")
    parser.add_argument("--admit-step-ratio", type=float, default=d.admit_step_ratio, metavar="R",
                        help="refuse new streams (busy) when the predicted engine step exceeds R x one frame "
                             "(40 ms); 0 = no admission by load (only --max-streams)")
    parser.add_argument("--quantize", choices=("none", "fp8", "int8"), default="none",
                        help="backbone linears at load: fp8 (W8A8, CUDA compute capability >= 8.9) or int8 "
                             "(weight-only, any device); embeddings, heads, norms and the codec stay as loaded")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="K/V pages in the model dtype (auto) or fp8 e4m3: --kv-pages then take half of "
                             "bf16's memory")
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
    parser.add_argument("--context-idle-timeout", type=float, default=d.context_idle_s, metavar="S",
                        help="end an open context (no `end` yet) with no message and no audio for S seconds")
    parser.add_argument("--http-body-timeout", type=float, default=d.http_body_timeout_s, metavar="S",
                        help="answer 408 when an HTTP request body has not arrived within S seconds")
    parser.add_argument("--max-reference-s", type=float, default=d.max_reference_s, metavar="S",
                        help="longest reference audio, checked from the file header before decoding")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of `higgs-stream serve`'s flags (ConfigError when one is invalid)."""
    aliases = {}
    for item in args.voice_alias:
        alias, sep, target = item.partition("=")
        if not sep:
            raise ConfigError(f"--voice-alias {item!r}: expected ALIAS=PRESET")
        aliases[alias] = target
    return ServerConfig(host=args.host, port=args.port, token=args.token, max_streams=args.max_streams,
                        max_frames=args.max_frames, default_mode=args.mode, voices_dir=args.voices,
                        voice_aliases=aliases, allowed_origins=tuple(args.allow_origin),
                        cors_origins=tuple(args.cors_origin),
                        ice_servers=tuple(args.ice_server), idle_timeout_s=args.idle_timeout,
                        context_idle_s=args.context_idle_timeout, http_body_timeout_s=args.http_body_timeout,
                        max_reference_s=args.max_reference_s, pause_ahead_s=args.pause_ahead,
                        resume_ahead_s=args.resume_ahead, admit_step_ratio=args.admit_step_ratio or None)


def build_state(args: argparse.Namespace) -> ServerState:
    import torch
    from higgs_stream.engine.checkpoint_files import resolve_model_dir
    from higgs_stream.engine.engine import EngineConfig, load_engine
    from higgs_stream.engine.models.registry import load_codec_for

    cfg = config_from_args(args)
    voices = VoiceLibrary.from_config(cfg)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if str(args.device).startswith("cuda")
                                                            else torch.float32)
    engine_cfg = EngineConfig(max_batch=max(64, cfg.max_streams), kv_cache_dtype=args.kv_cache_dtype,
                              **({"kv_pages": args.kv_pages} if args.kv_pages else {}))
    engine_args = {"device": args.device, "dtype": dtype, "config": engine_cfg,
                   "cuda_graphs": not args.no_cuda_graphs, "kernels": args.kernels, "quantize": args.quantize}
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
    metrics_ = Metrics()
    return ServerState(cfg, Pipeline(engine, codec, cfg, metrics_), voices, metrics_)


def startup_line(app: web.Application, host: str, port: int) -> str:
    """What `serve` logs once it listens: the address and the transports mounted."""
    paths = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    webrtc = ", WebRTC POST /v1/webrtc/offer" if "/v1/webrtc/offer" in paths else ", no WebRTC"
    return f"serving on http://{host}:{port} (WebSocket /v1/tts/stream, POST /v1/audio/speech{webrtc})"


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = build_state(args)
    app = make_app(state)
    log.info("%s", startup_line(app, args.host, args.port))
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, access_log=None)
    return 0
