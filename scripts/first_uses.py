"""First uses after start-up: each kind of request twice, one at a time, on a server that has just started.

The warm-up runs one utterance in the default voice; a request of another kind (a cloned voice, low-latency mode, an
HTTP format or sample rate) may meet code paths it did not run: kernels built on first use (`higgs_kernel_builds_total`,
stream/kernel_builds.py), cuDNN plans picked, PyAV codecs opened. Each kind runs twice in a row; the first request's
time to first audio against the second's shows what its first use cost, and the builds counter how many kernels were
built on the way. Prints a table, writes JSON.

    python scripts/first_uses.py --spawn "python -m higgs_stream.cli serve --model random:full --device cuda" \
        --url ws://127.0.0.1:8000/v1/tts/stream --out first_uses.json
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import re
import struct
import time
import urllib.request
from pathlib import Path

import aiohttp
from higgs_stream.loadgen.spawn import http_base, spawned_server

TEXT = "The quick brown fox jumps over the lazy dog before the morning train."


def reference_wav(seconds: float = 3.0, sr: int = 16000, f0: float = 150.0) -> bytes:
    """A voiced-like test tone (an `f0` fundamental with harmonics, amplitude-modulated) as a 16-bit WAV."""
    n = int(seconds * sr)
    samples = bytearray()
    for i in range(n):
        t = i / sr
        v = sum(math.sin(2 * math.pi * f0 * k * t) / k for k in range(1, 6)) * (0.6 + 0.4 * math.sin(2 * math.pi * 3 * t))
        samples += struct.pack("<h", int(6000 * v))
    out = io.BytesIO()
    out.write(b"RIFF" + struct.pack("<I", 36 + len(samples)) + b"WAVEfmt ")
    out.write(struct.pack("<IHHIIHH", 16, 1, 1, sr, 2 * sr, 2, 16) + b"data" + struct.pack("<I", len(samples)))
    out.write(samples)
    return out.getvalue()


def builds(base: str) -> dict[str, float]:
    """higgs_kernel_builds_total and _seconds_total by kind, from /metrics."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^(higgs_kernel_build(?:s|_seconds)_total)\{kind="(\w+)"\} (\S+)$', text, re.M):
        out[f"{m.group(1)}:{m.group(2)}"] = float(m.group(3))
    return out


async def ws_request(url: str, **options) -> dict:
    """One context over the WebSocket (aiohttp: the GPU machine has no `websockets`): time to its first audio, from
    before the connection is made (as `http_request` counts it)."""
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session, session.ws_connect(url, max_msg_size=0) as ws:
        await ws.send_str(json.dumps({"type": "text", "context_id": "c", "text": TEXT, "seed": 1, **options}))
        await ws.send_str(json.dumps({"type": "end", "context_id": "c"}))
        first, samples = None, 0
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.BINARY:
                first = time.perf_counter() if first is None else first
                samples += len(msg.data) // 2
            elif msg.type == aiohttp.WSMsgType.TEXT:
                event = json.loads(msg.data)
                if event["type"] == "error":
                    raise RuntimeError(f"{event.get('code')}: {event.get('message')}")
                if event["type"] == "done":
                    break
            else:
                break
    return {"first_audio_ms": None if first is None else 1e3 * (first - t0), "audio_s": samples / 24000}


def http_request(base: str, body: dict) -> dict:
    """POST /v1/audio/speech; time to the first body byte, and the bytes."""
    req = urllib.request.Request(base + "/v1/audio/speech", data=json.dumps({"input": TEXT, "seed": 1, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        first = resp.read(1)
        t1 = time.perf_counter()
        size = len(first) + len(resp.read())
    return {"first_audio_ms": 1e3 * (t1 - t0), "bytes": size}


def kinds(url: str, base: str, reference: dict, other: dict) -> list[tuple[str, object]]:
    """`reference` and `other`: two cloned voices (the server caches a reference's encoding by its content: each
    cloned kind gets its own, so its first use encodes)."""
    return [
        ("ws exact, default voice", lambda: asyncio.run(ws_request(url))),
        ("ws low-latency", lambda: asyncio.run(ws_request(url, mode="low_latency"))),
        ("ws cloned voice (3 s WAV, 16 kHz)", lambda: asyncio.run(ws_request(url, reference=reference))),
        ("http mp3 24 kHz", lambda: http_request(base, {"response_format": "mp3"})),
        ("http pcm 16 kHz", lambda: http_request(base, {"response_format": "pcm", "sample_rate": 16000})),
        ("http opus 48 kHz", lambda: http_request(base, {"response_format": "opus", "sample_rate": 48000})),
        ("http wav 44.1 kHz, cloned", lambda: http_request(base, {"response_format": "wav", "sample_rate": 44100,
                                                                 "reference_audio": other["audio"],
                                                                 "reference_text": other["transcript"]})),
    ]


def run(url: str) -> list[dict]:
    import base64

    base = http_base(url)
    reference, other = ({"audio": base64.b64encode(reference_wav(f0=f0)).decode("ascii"),
                         "transcript": "A test tone read as if it were speech."} for f0 in (150.0, 210.0))
    rows = []
    for name, fn in kinds(url, base, reference, other):
        row: dict = {"kind": name}
        for attempt in ("first", "second"):
            before = builds(base)
            try:
                row[attempt] = fn()
            except Exception as exc:  # a probe: say what failed, go on with the next kind
                row[attempt] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            after = builds(base)
            row[attempt]["builds"] = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()
                                      if v != before.get(k, 0.0)}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'kind':36s} {'first ms':>9s} {'second ms':>9s}  builds on the first (kind: count, s)"]
    for r in rows:
        def ms(a):
            v = r[a].get("first_audio_ms")
            return f"{v:9.1f}" if v is not None else f"{'err':>9s}"
        lines.append(f"{r['kind']:36s} {ms('first')} {ms('second')}  {r['first']['builds'] or '-'}"
                     + (f"  ERROR {r['first'].get('error') or r['second'].get('error')}"
                        if "error" in r["first"] or "error" in r["second"] else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts/stream")
    ap.add_argument("--spawn", default=None, help="start this server command, wait for /healthz, run, stop it")
    ap.add_argument("--spawn-log", default="first_uses_server.log")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    if args.spawn:
        with spawned_server(args.spawn, args.url, Path(args.spawn_log), 600.0):
            rows = run(args.url)
    else:
        rows = run(args.url)
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"url": args.url, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
