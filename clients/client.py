"""Python client for the streaming WebSocket protocol (stream/PROTOCOL.md §1), and `higgs-stream say`.

    async for pcm in stream_tts("ws://127.0.0.1:8000/v1/tts/stream", "Hello there.", seed=1):
        ...  # s16le mono 24 kHz bytes, as soon as the server sends them

`synthesize(url, text, ...)` is the blocking form (all PCM as bytes). Each call opens one
connection and speaks one context; leaving the loop early closes the socket, which cancels the
generation on the server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import errno
import io
import json
import os
import signal
import stat
import sys
import threading
import time
import uuid
import wave
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedError, ConnectionClosedOK, InvalidHandshake, InvalidURI
from websockets.sync.client import connect as connect_sync

from higgs_stream.engine.errors import (
    AudioInputError,
    CancelledStream,
    CapacityError,
    HiggsStreamError,
    InvalidInputError,
    NotFoundError,
)

SAMPLE_RATE = 24000
DEFAULT_URL = "ws://127.0.0.1:8000/v1/tts/stream"
_OPTION_KEYS = ("voice", "reference", "mode", "seed", "temperature", "top_k", "top_p", "scene", "instructions")
MAX_FRAME_BYTES = 16 << 20  # a server frame past it closes the connection (1009): the server sends <= ~64 KB
READ_TIMEOUT_S = 60.0  # no message for this long: ClientConnectionError (the server is never silent ~2 s while it
# generates, PROTOCOL.md rule 5; a stalled one held the client forever, a probe)


class ClientConnectionError(HiggsStreamError):
    """The server could not be reached, refused the upgrade, or dropped the connection."""

    code = "connection"


class ProtocolError(HiggsStreamError):
    """The server sent something the protocol does not allow (not JSON, not an object, a chunk without data, an odd
    PCM byte count): a client bug's or a wrong server's, raised typed (tracebacks before, found by a probe)."""

    code = "protocol"


class OutputError(HiggsStreamError):
    """`say` could not write its output file."""

    code = "output"


class Interrupted(HiggsStreamError):
    """`say` was stopped by a signal (SIGINT, SIGTERM, SIGHUP): its request was cancelled (the connection closed)
    and the partial WAV it had written removed."""

    code = "interrupted"

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


class ServerError(HiggsStreamError):
    """An `error` message from the server whose code has no more specific class here."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


_ERRORS: dict[str, type[HiggsStreamError]] = {
    "invalid_input": InvalidInputError,
    "not_found": NotFoundError,
    "busy": CapacityError,
    "bad_audio": AudioInputError,
}


def error_from_message(msg: dict) -> HiggsStreamError:
    """The typed exception for a server `error` message."""
    code, text = str(msg.get("code", "internal")), str(msg.get("message", ""))
    cls = _ERRORS.get(code)
    return cls(f"server: {text}") if cls is not None else ServerError(code, f"server [{code}]: {text}")


def reference_from_file(path: str | Path, transcript: str) -> dict:
    """A `reference` option (voice cloning) from an audio file and its transcript."""
    data = Path(path).read_bytes()
    return {"audio": base64.b64encode(data).decode("ascii"), "transcript": transcript}


@dataclass
class StreamStats:
    """What one `stream_tts` call measured (filled in as it runs)."""

    started: float = field(default_factory=time.perf_counter)
    first_audio_s: float | None = None  # from sending the text to the first PCM byte
    samples: int = 0
    chunks: int = 0
    done: dict | None = None  # the server's `done` message

    @property
    def audio_s(self) -> float:
        return self.samples / SAMPLE_RATE


class _ContextReader:
    """Sans-I/O reading of one context's replies: `feed(message)` returns PCM bytes (maybe empty)
    and sets `finished` at `done{completed}`; other endings raise typed errors."""

    def __init__(self, context_id: str, stats: StreamStats):
        self.context_id = context_id
        self.stats = stats
        self.finished = False

    def feed(self, message: str | bytes) -> bytes:
        if isinstance(message, bytes):
            return self._pcm(message)
        try:
            msg = json.loads(message)
        except (ValueError, RecursionError) as e:
            raise ProtocolError(f"server sent a text message that is not JSON: {str(e)[:200]}") from None
        if not isinstance(msg, dict):
            raise ProtocolError(f"server sent a JSON {type(msg).__name__}, not an object")
        kind = msg.get("type")
        if kind == "chunk" and msg.get("context_id") == self.context_id:
            try:
                return self._pcm(base64.b64decode(msg["data"], validate=True))
            except (KeyError, TypeError, ValueError) as e:  # binascii.Error is a ValueError
                raise ProtocolError(f"server sent a chunk without base64 audio data ({type(e).__name__})") from None
        if kind == "error" and msg.get("context_id") in (None, self.context_id):
            raise error_from_message(msg)
        if kind == "done" and msg.get("context_id") == self.context_id:
            self.stats.done = msg
            if msg.get("reason") == "cancelled":
                raise CancelledStream(f"context {self.context_id!r} was cancelled by the server")
            if msg.get("reason") != "completed":
                raise ServerError("internal", f"context {self.context_id!r} ended with {msg.get('reason')!r}")
            if msg.get("samples", self.stats.samples) != self.stats.samples:
                raise ServerError("internal", f"server counted {msg.get('samples')} samples, "
                                              f"{self.stats.samples} arrived")
            self.finished = True
        return b""  # ready, audio_start, and messages of other contexts carry no audio for us

    def _pcm(self, data: bytes) -> bytes:
        if len(data) % 2:
            raise ProtocolError(f"server sent an odd PCM byte count ({len(data)})")
        if self.stats.first_audio_s is None:
            self.stats.first_audio_s = time.perf_counter() - self.stats.started
        self.stats.samples += len(data) // 2
        self.stats.chunks += 1
        return data


def _request(text: str, context_id: str, options: dict[str, Any]) -> list[str]:
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError("text must be a non-empty string")
    unknown = set(options) - set(_OPTION_KEYS)
    if unknown:
        raise InvalidInputError(f"unknown option(s): {', '.join(sorted(unknown))}")
    given = {k: v for k, v in options.items() if v is not None}
    return [json.dumps({"type": "text", "context_id": context_id, "text": text, **given}),
            json.dumps({"type": "end", "context_id": context_id})]


_CONNECT_ERRORS = (OSError, InvalidHandshake, InvalidURI, TimeoutError, ValueError)  # ValueError: a bad port


def _headers(token: str | None) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {token}"} if token else None


async def _recv(ws: Any, timeout: float) -> str | bytes:
    """The next message, TimeoutError after `timeout` s without one. A cancel is never lost: `asyncio.wait_for`
    (before Python 3.12) returned a message that arrived in the cancel's loop iteration and dropped the cancel, so
    a SIGINT to `say` was now and then unheard and the whole utterance streamed on (1 run of its test in 9)."""
    recv = asyncio.ensure_future(ws.recv())
    try:
        done, _ = await asyncio.wait({recv}, timeout=timeout)
    except asyncio.CancelledError:
        recv.cancel()
        if recv.done() and not recv.cancelled():  # it had ended too: its error (a close), if any, is read so that
            recv.exception()  # asyncio logs no "exception was never retrieved"
        raise
    if not done:
        recv.cancel()
        raise TimeoutError
    return recv.result()


async def stream_tts(
    url: str,
    text: str,
    *,
    token: str | None = None,
    stats: StreamStats | None = None,
    open_timeout: float = 10.0,
    read_timeout: float = READ_TIMEOUT_S,
    **options: Any,
) -> AsyncIterator[bytes]:
    """Stream one utterance: yields s16le mono 24 kHz PCM chunks as the server sends them.

    `options` are the per-context options of the protocol: voice, reference (see
    `reference_from_file`), mode, seed, temperature, top_k, top_p, scene, instructions. Server errors raise
    typed `HiggsStreamError`s; a server-side cancel raises `CancelledStream`; no message for `read_timeout` s a
    `ClientConnectionError`.
    """
    context_id = uuid.uuid4().hex
    requests = _request(text, context_id, options)
    stats = stats if stats is not None else StreamStats()
    reader = _ContextReader(context_id, stats)
    try:
        ws = await connect(url, additional_headers=_headers(token), compression=None,
                           open_timeout=open_timeout, max_size=MAX_FRAME_BYTES)
    except _CONNECT_ERRORS as e:
        raise ClientConnectionError(f"cannot connect to {url}: {e}") from e
    async with ws:
        stats.started = time.perf_counter()
        try:
            try:
                for message in requests:
                    await ws.send(message)
            except ConnectionClosed:
                pass  # closed at once (e.g. unauthorized): the reason is among the messages read next
            while True:
                try:
                    message = await _recv(ws, read_timeout)
                except ConnectionClosedOK:
                    break
                pcm = reader.feed(message)
                if pcm:
                    yield pcm
                if reader.finished:
                    return
        except ConnectionClosedError as e:
            raise ClientConnectionError(f"connection to {url} dropped: {e}") from e
        except TimeoutError:
            raise ClientConnectionError(f"no message from {url} for {read_timeout:g} s") from None
    raise ClientConnectionError(f"server closed the connection before context {context_id!r} finished")


def iter_tts(url: str, text: str, *, token: str | None = None, stats: StreamStats | None = None,
             open_timeout: float = 10.0, read_timeout: float = READ_TIMEOUT_S, **options: Any) -> Iterator[bytes]:
    """Blocking `stream_tts`: yields PCM chunks as they arrive."""
    context_id = uuid.uuid4().hex
    requests = _request(text, context_id, options)
    stats = stats if stats is not None else StreamStats()
    reader = _ContextReader(context_id, stats)
    try:
        ws = connect_sync(url, additional_headers=_headers(token), compression=None,
                          open_timeout=open_timeout, max_size=MAX_FRAME_BYTES)
    except _CONNECT_ERRORS as e:
        raise ClientConnectionError(f"cannot connect to {url}: {e}") from e
    with ws:
        stats.started = time.perf_counter()
        try:
            try:
                for message in requests:
                    ws.send(message)
            except ConnectionClosed:
                pass  # closed at once (e.g. unauthorized): the reason is among the messages read next
            while True:
                try:
                    message = ws.recv(timeout=read_timeout)
                except ConnectionClosedOK:
                    break
                pcm = reader.feed(message)
                if pcm:
                    yield pcm
                if reader.finished:
                    return
        except ConnectionClosedError as e:
            raise ClientConnectionError(f"connection to {url} dropped: {e}") from e
        except TimeoutError:
            raise ClientConnectionError(f"no message from {url} for {read_timeout:g} s") from None
    raise ClientConnectionError(f"server closed the connection before context {context_id!r} finished")


def synthesize(url: str, text: str, **kwargs: Any) -> bytes:
    """Blocking: all PCM (s16le mono 24 kHz) of one utterance."""
    return b"".join(iter_tts(url, text, **kwargs))


class WavStreamWriter:
    """Writes a mono s16le WAV as chunks arrive; the header is valid after every `write`."""

    def __init__(self, path: str | Path, sample_rate: int = SAMPLE_RATE):
        self._file = open(path, "wb")
        if not self._file.seekable():  # a pipe or FIFO: the header could not be patched (wave: Illegal seek)
            self._file.close()
            raise OSError(errno.ESPIPE, "not seekable (a pipe?); use -o - to write the WAV to stdout")
        self._wav = wave.open(self._file, "wb")
        self._wav.setnchannels(1)
        self._wav.setsampwidth(2)
        self._wav.setframerate(sample_rate)

    def write(self, pcm: bytes) -> None:
        self._wav.writeframes(pcm)  # also patches the RIFF/data sizes (the file is seekable)
        self._file.flush()

    def close(self) -> None:
        self._wav.close()  # does not close a file object it was given
        self._file.close()

    def __enter__(self) -> WavStreamWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def say(url: str, text: str, out: str | Path, *, token: str | None = None, stats: StreamStats | None = None,
              **options: Any) -> StreamStats:
    """Stream `text` into the WAV file `out`, writing each chunk as it arrives; `out="-"` writes
    the WAV to stdout once the utterance is complete (a pipe cannot have its header patched).

    On any failure, a cancel included, no WAV is left behind: the partly written file is removed, stdout gets
    nothing; a failure before any audio (no server, a refused request) leaves a file that was at `out` as it was
    (`stats.samples == 0`: `out` was not opened).
    """
    stats = stats if stats is not None else StreamStats()
    if str(out) == "-":
        pcm = b"".join([c async for c in stream_tts(url, text, token=token, stats=stats, **options)])
        try:
            sys.stdout.buffer.write(_wav_bytes(pcm))
            sys.stdout.buffer.flush()
        except OSError as e:  # a closed pipe, a full disk
            raise OutputError(f"cannot write stdout: {e.strerror or e}") from e
        return stats
    check_output(out)
    wav: WavStreamWriter | None = None  # opened at the first audio: a failure before it leaves `out` as it was
    try:
        try:
            try:
                async for pcm in stream_tts(url, text, token=token, stats=stats, **options):
                    if wav is None:
                        wav = WavStreamWriter(out)
                    wav.write(pcm)
                if wav is None:  # completed without audio: an empty WAV
                    wav = WavStreamWriter(out)
            finally:
                if wav is not None:
                    wav.close()
        except OSError as e:  # writing (a full disk, /dev/full); the network's errors are typed in stream_tts
            raise OutputError(f"cannot write {out}: {e.strerror or e}") from e
    except BaseException:  # also a cancel or Ctrl-C: a truncated WAV would look like a good one
        if wav is not None and Path(out).is_file():  # what this call wrote; never a device such as /dev/null
            Path(out).unlink()
        raise
    return stats


INTERRUPTS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


async def until_interrupted(main: Coroutine[Any, Any, Any], *, exiting: bool = False) -> Any:
    """Await `main`; a SIGINT, SIGTERM or SIGHUP meanwhile cancels it (so its cleanup runs: `say` closes the
    connection, which cancels the generation on the server, and removes its partial WAV) and raises Interrupted.
    The handlers are the running loop's, installed for this call only and only on the main thread (elsewhere, e.g.
    `cli.main` in a worker thread, Python cannot take signals: they keep their handlers). `exiting` (the CLI, which
    exits once interrupted): after an interruption those signals stay ignored, so the first one decides the exit code."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    caught: list[int] = []

    def stop(signum: int) -> None:
        if not caught:  # the first signal decides the exit code; a second one changes nothing
            caught.append(signum)
            task.cancel()

    installed = []
    if threading.current_thread() is threading.main_thread():
        for signum in INTERRUPTS:
            try:
                loop.add_signal_handler(signum, stop, signum)
            except (NotImplementedError, RuntimeError):  # a loop without signal support (Windows)
                continue
            installed.append(signum)
    try:
        return await task
    except asyncio.CancelledError:
        if caught:
            raise Interrupted(caught[0]) from None
        raise
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
            if caught and exiting:  # the caller exits with the first signal's code next: a second one's default
                signal.signal(signum, signal.SIG_IGN)  # action must not replace it (a probe: 143 for 130)


def check_output(out: str | Path) -> None:
    """OutputError for an output `say` cannot write, checked before it connects and without touching the file: a
    pipe or FIFO (its WAV header could not be patched), a folder, a folder that does not exist or is not writable."""
    path = Path(out)
    try:
        st = path.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"cannot write {out}: {e.strerror or e}") from e
    if st is not None and (stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
        raise OutputError(f"cannot write {out}: not seekable (a pipe?); use -o - to write the WAV to stdout")
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"cannot write {out}: it is a folder")
    folder = path.parent
    if st is None and not (folder.is_dir() and os.access(folder, os.W_OK)):
        raise OutputError(f"cannot write {out}: the folder {folder} does not exist or is not writable")


def _wav_bytes(pcm: bytes, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A complete mono s16le WAV holding `pcm`."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return buf.getvalue()


# ---- `higgs-stream say` ----

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="text to speak")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server WebSocket URL (default {DEFAULT_URL})")
    parser.add_argument("-o", "--output", required=True, help="WAV file to write (written as audio arrives; removed on failure); - for stdout")
    parser.add_argument("--token", default=os.environ.get("HIGGS_STREAM_TOKEN"),
                        help="auth token, when the server runs with --token (default: $HIGGS_STREAM_TOKEN)")
    parser.add_argument("--voice", default=None, help="preset voice name (see GET /v1/voices)")
    parser.add_argument("--reference-audio", default=None, help="audio file to clone the voice of")
    parser.add_argument("--reference-text", default=None, help="transcript of --reference-audio")
    parser.add_argument("--mode", choices=("exact", "low_latency"), default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--scene", default=None, help="scene description")
    parser.add_argument("--instructions", default=None, help="voice/style description (Qwen3-TTS VoiceDesign)")


def _left_behind(out: str, stats: StreamStats) -> str:
    """What an interrupted `say` left at `out`: nothing before the first audio (a file already there is as it was);
    after it, `say` had opened `out` and removed it (unless it is a device such as /dev/null)."""
    if out == "-" or stats.samples == 0:
        return "no output written"
    if not os.path.lexists(out):
        return f"partial output {out} removed"
    return f"{out} is not a regular file: left as it is"


def run(args: argparse.Namespace) -> int:
    if (args.reference_audio is None) != (args.reference_text is None):
        raise InvalidInputError("--reference-audio and --reference-text go together")
    if args.reference_audio is not None and args.output != "-" and os.path.exists(args.output) and \
            os.path.samefile(args.reference_audio, args.output):
        raise InvalidInputError("--reference-audio and -o are the same file (the recording would be overwritten)")
    try:
        reference = (reference_from_file(args.reference_audio, args.reference_text)
                     if args.reference_audio is not None else None)
    except OSError as e:
        raise InvalidInputError(f"cannot read {args.reference_audio}: {e.strerror or e}") from e
    stats = StreamStats()
    try:
        asyncio.run(until_interrupted(say(args.url, args.text, args.output, token=args.token, stats=stats,
                                          voice=args.voice, reference=reference, mode=args.mode, seed=args.seed,
                                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                          scene=args.scene, instructions=args.instructions), exiting=True))
    except Interrupted as e:  # one line and the shell's code for death by that signal (128 + its number)
        print(f"higgs-stream say: {e}; {_left_behind(args.output, stats)}", file=sys.stderr)
        return 128 + e.signum
    wall = time.perf_counter() - stats.started
    first = f"{stats.first_audio_s * 1000:.0f} ms" if stats.first_audio_s is not None else "never"
    where = "stdout" if args.output == "-" else args.output
    print(f"wrote {where}: {stats.audio_s:.2f} s of audio in {wall:.2f} s "
          f"(first audio after {first}, {stats.chunks} chunks)", file=sys.stderr)
    return 0
