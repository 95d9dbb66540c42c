"""Ray Serve: many GPUs and hosts behind one endpoint, with the same protocols (research/scaleout.md
§2, §7). `higgs-stream serve --ray ...`, or `serve run serve_config.yaml` (import path
`higgs_stream.stream.ray_app:build_app`).

One deployment, `TTSReplica`. Each replica holds one engine + codec pipeline (one GPU:
`num_gpus: 1`, Ray sets `CUDA_VISIBLE_DEVICES`) and serves the ASGI app of stream/asgi.py, so a
WebSocket or a streamed HTTP response ends on the replica that generates it and stays there for
its life; no separate ingress (one hop). Admission has two guards: Serve's
`max_ongoing_requests` = the replica's stream capacity (`--max-streams`; a connection or an HTTP
request is one ongoing request), beyond which up to `max_queued_requests` wait at the proxy for a
free slot and the rest get `503 busy` at once; then the replica's own admission (`busy` per context,
also when one connection opens several). `check_health` fails once the engine loop is not alive.
Drain: a replica being stopped gets no new requests and its streams finish, for up to
`graceful_shutdown_timeout_s`. Each replica exports its metrics to Ray's Prometheus endpoint,
tagged with its replica id (`RayMetricsExport`), and names itself in every response
(`X-Higgs-Replica`).

Serve's proxy answers some requests itself (over capacity, a replica that died); `proxy_middlewares`
(installed with RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, set before the proxies start) makes those
answers the protocol's typed errors: a WebSocket refused at the proxy gets `503` + `busy` on the
upgrade (Serve's own answer there is a bare 500), a connection whose replica died gets
`error{internal}` and close 1011 at once (instead of a dropped TCP connection), a plain-text 503/500
becomes the JSON error of PROTOCOL.md §3. It also turns on TCP_NODELAY for the proxy's client
connections: Serve's listening socket is made without IPPROTO_TCP, so asyncio leaves Nagle on and a
small frame written right after another (audio_start, then the first audio) waits for the client's
delayed ACK, up to 40 ms.

WebRTC is not served here (README, Scale-out): its signalling would route, but the peer connection
outlives the request, so Serve's admission, autoscaling and drain would not see it, and its media
goes peer to peer to the replica's host. The standalone server (`serve` without `--ray`) is its path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import time
from typing import Any

from ray import serve
from starlette.middleware import Middleware

from higgs_stream.stream.metrics import Metrics

log = logging.getLogger(__name__)

APP_NAME = "higgs"
REPLICA_HEADER = "x-higgs-replica"
PROXY_CALLBACK = "higgs_stream.stream.ray_app:proxy_middlewares"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
EXPORT_EVERY_S = 2.0  # how often a replica copies its metrics into Ray's
TARGET_SHARE = 0.7  # autoscaling: target ongoing requests per replica = this share of its capacity


# ---------------------------------------------------------------- the replicas' flags

def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """`serve` flags as a dict (`{"max_streams": 256, "voice_alias": ["a=b"]}`) -> argv."""
    argv: list[str] = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def replica_parser() -> argparse.ArgumentParser:
    from higgs_stream.stream.serve_command import add_arguments

    parser = argparse.ArgumentParser(prog="higgs-stream serve (replica)")
    add_arguments(parser)
    return parser


# ---------------------------------------------------------------- the deployment

@serve.deployment(name="TTSReplica")
@serve.ingress()
class TTSReplica:
    """One replica: the engine + codec pipeline of `serve ARGV` behind the ASGI app."""

    async def __init__(self, argv: list[str]):
        from higgs_stream.stream.serve_command import build_state

        args = replica_parser().parse_args(argv)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.state = await asyncio.to_thread(build_state, args)  # model load: minutes for a real checkpoint
        self._export = RayMetricsExport(self.state.metrics)
        self._export_task = asyncio.create_task(self._export.run(EXPORT_EVERY_S), name="metrics-export")
        log.info("replica %s ready: %s on %s, %d streams", self.replica_id, args.model, args.device, args.max_streams)

    def __serve_build_asgi_app__(self):
        from higgs_stream.stream.asgi import make_asgi_app

        # Serve's graceful_shutdown_timeout_s (--drain-timeout) is the drain: its requests had that long to end, so
        # the app's own drain at the lifespan's end ends what is left at once (shutting_down + done), not waits again
        return ReplicaHeader(make_asgi_app(self.state, drain_s=0.0), self.replica_id)

    def check_health(self) -> None:
        """Serve restarts a replica whose engine loop is not alive (3 failed checks)."""
        if not self.state.pipeline.healthy:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop is not running")

    async def __del__(self):
        self._export_task.cancel()


class ReplicaHeader:
    """Every response and WebSocket upgrade names the replica that served it (`X-Higgs-Replica`)."""

    def __init__(self, app, replica_id: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope, receive, send):
        async def named(message: dict) -> None:
            if message["type"] in ("http.response.start", "websocket.accept", "websocket.http.response.start"):
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


class RayMetricsExport:
    """Copies a replica's `Metrics` into Ray's metrics every few seconds (`ray.serve.metrics`
    gauges: Serve tags them with the application, deployment and replica). Ray's metrics agent on
    each node serves them to Prometheus as `ray_higgs_*` (`ray start --metrics-export-port`);
    counters and histogram series are exported as gauges holding the replica's totals."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._gauges: dict[str, Any] = {}

    def export(self) -> None:
        from ray.serve.metrics import Gauge

        for metric in self.metrics.all():
            for name, labels, value in metric.samples():
                gauge = self._gauges.get(name)
                if gauge is None:
                    gauge = self._gauges[name] = Gauge(name, description=metric.help, tag_keys=tuple(labels))
                gauge.set(value, tags=labels or None)

    async def run(self, every_s: float) -> None:
        while True:
            try:
                self.export()
            except Exception:  # noqa: BLE001 -- metrics must never take a replica down; say so and go on
                log.exception("exporting metrics to Ray failed")
            await asyncio.sleep(every_s)


def deployment_options(args: argparse.Namespace, cluster_gpus: float) -> dict[str, Any]:
    """Serve options of the deployment from the `serve --ray` flags (serve_config.yaml may override
    any of them under `deployments:`)."""
    gpus = args.gpus_per_replica if args.gpus_per_replica is not None else (1 if cluster_gpus >= 1 else 0)
    replicas = args.replicas or max(1, int(cluster_gpus // gpus) if gpus else 1)
    options: dict[str, Any] = {
        "ray_actor_options": {"num_gpus": gpus, "num_cpus": args.cpus_per_replica},
        "max_ongoing_requests": args.max_streams,
        "max_queued_requests": args.max_queued,
        "graceful_shutdown_timeout_s": args.drain_timeout,
        "graceful_shutdown_wait_loop_s": min(2.0, args.drain_timeout),
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 30.0,
    }
    if args.max_replicas and args.max_replicas > replicas:
        options["autoscaling_config"] = {
            "min_replicas": replicas, "initial_replicas": replicas, "max_replicas": args.max_replicas,
            "target_ongoing_requests": max(1.0, TARGET_SHARE * args.max_streams),
            "upscale_delay_s": 30.0, "downscale_delay_s": 600.0,
        }
    else:
        options["num_replicas"] = replicas
    return options


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application of serve_config.yaml: `args` are `higgs-stream serve` flags as a dict
    (`{"model": ..., "max_streams": 256}`), the Ray ones included (`replicas`, `max_queued`, ...)."""
    import ray
    from higgs_stream.stream.serve_command import RAY_FLAGS, add_arguments

    parser = argparse.ArgumentParser(prog="higgs_stream.stream.ray_app:build_app")
    add_arguments(parser)
    ns = parser.parse_args(flags_to_argv(args))  # fails here, in the driver, on a bad flag
    replica_argv = flags_to_argv({k: v for k, v in args.items() if k not in RAY_FLAGS})

    gpus = ray.cluster_resources().get("GPU", 0.0) if ray.is_initialized() else 0.0
    return TTSReplica.options(**deployment_options(ns, gpus)).bind(replica_argv)


# ---------------------------------------------------------------- Serve's proxy, made to speak the protocol

def _error_body(code: str, message: str, status: int) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "code": code, "param": None}}).encode()


class ProxyGuard:
    """ASGI middleware in Serve's proxy (see the module doc): its own answers become typed errors."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] == "http":
            return await self._http(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _websocket(self, scope, receive, send):
        seen = {"accepted": False, "closed": False, "gone": False, "refused": None}

        async def watched_receive() -> dict:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                seen["gone"] = True
            return message

        async def guarded_send(message: dict) -> None:
            kind = message["type"]
            if kind == "http.response.start":  # Serve refused before any replica accepted (backpressure: 503)
                seen["refused"] = message.get("status", 500)
                return
            if kind == "http.response.body":
                return
            if kind == "websocket.accept":
                seen["accepted"] = True
            elif kind == "websocket.close":
                seen["closed"] = True
            await send(message)

        try:
            await self.app(scope, watched_receive, guarded_send)
        finally:
            if not seen["accepted"] and seen["refused"] is not None:
                await self._refuse(scope, send, seen["refused"])
            elif seen["accepted"] and not seen["closed"] and not seen["gone"]:
                # the replica ended without closing: it died (or its actor call failed)
                try:
                    await send({"type": "websocket.send", "text": json.dumps(
                        {"type": "error", "code": "internal", "message": "the server replica of this connection failed"})})
                    await send({"type": "websocket.close", "code": 1011, "reason": "replica failed"})
                except (OSError, RuntimeError):
                    pass  # the client is gone too

    @staticmethod
    async def _refuse(scope, send, status: int) -> None:
        busy = status in (429, 503)
        code, status = ("busy", 503) if busy else ("internal", 500)
        body = _error_body(code, "server at capacity, retry later" if busy else "the server could not take the connection",
                           status)
        try:
            if "websocket.http.response" in (scope.get("extensions") or {}):
                headers = [(b"content-type", b"application/json; charset=utf-8"), (b"content-length", str(len(body)).encode())]
                if busy:
                    headers.append((b"retry-after", b"1"))
                await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
                await send({"type": "websocket.http.response.body", "body": body})
            else:
                await send({"type": "websocket.close", "code": 1013 if busy else 1011})
        except (OSError, RuntimeError):
            pass

    async def _http(self, scope, receive, send):
        held: dict[str, Any] = {"status": None, "started": False, "done": False, "sse": False}

        async def guarded_send(message: dict) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                ctype = headers.get(b"content-type", b"")
                if message.get("status") in (500, 503) and not ctype.startswith(b"application/json"):
                    held["status"] = message["status"]  # Serve's own plain-text answer: replaced below
                    return
                held["started"], held["sse"] = True, ctype.startswith(b"text/event-stream")
            elif kind == "http.response.body":
                if held["status"] is not None:
                    if not message.get("more_body", False):
                        busy = held["status"] == 503
                        body = _error_body("busy" if busy else "internal",
                                           "server at capacity, retry later" if busy else "internal server error",
                                           held["status"])
                        headers = [(b"content-type", b"application/json; charset=utf-8"),
                                   (b"content-length", str(len(body)).encode())]
                        if busy:
                            headers.append((b"retry-after", b"1"))
                        await send({"type": "http.response.start", "status": held["status"], "headers": headers})
                        await send({"type": "http.response.body", "body": body})
                    return
                if not message.get("more_body", False):
                    held["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, guarded_send)
        finally:
            if held["started"] and not held["done"] and held["sse"]:
                # a server-sent-events stream whose replica died: end it with the protocol's error event
                event = {"type": "error", "error": {"code": "internal", "message": "the server replica failed"}}
                try:
                    await send({"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n",
                                "more_body": False})
                except (OSError, RuntimeError):
                    pass


def _nodelay_on_client_connections() -> None:
    """Serve's proxy listens on a socket made without IPPROTO_TCP, so asyncio does not set
    TCP_NODELAY on the connections it accepts; set it when uvicorn's HTTP protocol gets one (a
    WebSocket keeps the connection's socket)."""
    from uvicorn.protocols.http import h11_impl

    classes = [h11_impl.H11Protocol]
    try:
        from uvicorn.protocols.http import httptools_impl

        classes.append(httptools_impl.HttpToolsProtocol)
    except ImportError:  # httptools not installed: uvicorn uses h11
        pass
    for cls in classes:
        if getattr(cls, "_higgs_nodelay", False):
            continue
        original = cls.connection_made

        def connection_made(self, transport, _original=original):
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            _original(self, transport)

        cls.connection_made = connection_made
        cls._higgs_nodelay = True


def proxy_middlewares() -> list[Middleware]:
    """RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=higgs_stream.stream.ray_app:proxy_middlewares
    (called once in each proxy, before it listens)."""
    _nodelay_on_client_connections()
    return [Middleware(ProxyGuard)]


# ---------------------------------------------------------------- higgs-stream serve --ray

def run(args: argparse.Namespace) -> int:
    """`higgs-stream serve --ray`: start (or join) Ray, deploy, serve until SIGINT/SIGTERM."""
    import ray

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)  # a Ray started here passes it to its proxies
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=args.ray_address, include_dashboard=False, logging_level=logging.WARNING)
    # SIGTERM stops like Ctrl-C (after ray.init, whose own handler would abort the process)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        serve.start(proxy_location="EveryNode", http_options={"host": args.host, "port": args.port})
        t0 = time.monotonic()
        serve.run(build_app(given_flags(args)), name=APP_NAME, route_prefix="/")
        status = serve.status().applications[APP_NAME].deployments["TTSReplica"]
        print(f"ready: {status.replica_states.get('RUNNING', 0)} replicas on http://{args.host}:{args.port} "
              f"(WebSocket /v1/tts/stream, POST /v1/audio/speech; WebRTC: use the standalone server) "
              f"after {time.monotonic() - t0:.0f} s", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log.info("shutting down Serve")
    finally:
        serve.shutdown()
    return 0


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The `serve` flags given on the command line (values other than the defaults) as a dict;
    the proxy's address (`--host`, `--port`) is Serve's, not the replicas'."""
    from higgs_stream.stream.serve_command import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    dests = set(vars(parser.parse_args(["--model", args.model]))) - {"ray", "ray_address", "host", "port"}
    return {"model": args.model} | {k: v for k, v in vars(args).items()
                                    if k in dests and v != parser.get_default(k)}
