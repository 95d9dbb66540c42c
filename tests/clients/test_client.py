"""The Python client and `higgs-stream say` against a live server on the tiny random checkpoint."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import wave
from pathlib import Path

import pytest

from higgs_stream import cli
from higgs_stream.clients.client import (
    ClientConnectionError,
    Interrupted,
    ProtocolError,
    ServerError,
    StreamStats,
    WavStreamWriter,
    reference_from_file,
    say,
    stream_tts,
    synthesize,
    until_interrupted,
)
from higgs_stream.engine.errors import AudioInputError, InvalidInputError, NotFoundError
from higgs_stream.testing import assert_pcm_close

TEXT = "The quick brown fox jumps over the lazy dog."
SEED = 4


async def test_stream_and_say_equal_offline_synthesis(live_server, reference_pcm, tmp_path):
    stats = StreamStats()
    chunks = [c async for c in stream_tts(live_server.ws, TEXT, seed=SEED, stats=stats)]
    out = tmp_path / "say.wav"
    code = await asyncio.to_thread(cli.main, ["say", TEXT, "--url", live_server.ws, "-o", str(out),
                                              "--seed", str(SEED)])
    blocking = await asyncio.to_thread(synthesize, live_server.ws, TEXT, seed=SEED)
    assert code == 0

    await live_server.state.pipeline.stop()  # idle now; the engine is not thread-safe
    expected = reference_pcm(live_server.state, TEXT, SEED)
    assert len(expected) > 48000  # > 1 s of audio
    streamed = b"".join(chunks)
    assert_pcm_close(streamed, expected, what="streamed")
    assert_pcm_close(blocking, expected, what="blocking")
    # It streamed: a small first chunk (one 40 ms frame + the few exact samples past it), then more chunks.
    assert 960 <= len(chunks[0]) // 2 < 9 * 960 and len(chunks) >= 4, [len(c) for c in chunks]  # 1 frame when idle, more under load
    assert stats.samples * 2 == len(expected) and stats.done["samples"] == stats.samples
    assert 0 < stats.first_audio_s < 30
    with wave.open(str(out), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() * 2 == len(expected)
        assert_pcm_close(w.readframes(w.getnframes()), expected, what="say wav")


def test_wav_writer_header_is_valid_after_every_chunk(tmp_path):
    path = tmp_path / "partial.wav"
    chunks = [bytes(range(256)) * 4, b"\x01\x00" * 300]
    with WavStreamWriter(path) as wav:
        written = b""
        for chunk in chunks:
            wav.write(chunk)
            written += chunk
            with wave.open(str(path), "rb") as r:  # readable mid-stream, with the right length
                assert r.getnframes() * 2 == len(written)
                assert r.readframes(r.getnframes()) == written


async def test_leaving_the_loop_cancels_generation_on_the_server(live_server):
    pipeline = live_server.state.pipeline
    async for _ in stream_tts(live_server.ws, TEXT, seed=SEED):
        break  # closes the socket
    async with asyncio.timeout(10):  # the server sees the close and cancels the engine stream
        while pipeline.active or pipeline.engine.num_active:
            await asyncio.sleep(0.02)
    assert 'outcome="disconnected"' in live_server.state.metrics.render()  # it went away; it did not cancel


async def test_server_errors_raise_typed_exceptions(live_server, tmp_path):
    with pytest.raises(NotFoundError, match="no-such-voice"):
        async for _ in stream_tts(live_server.ws, TEXT, voice="no-such-voice"):
            pass
    with pytest.raises(InvalidInputError, match="temperature"):
        async for _ in stream_tts(live_server.ws, TEXT, temperature=5.0):
            pass
    with pytest.raises(InvalidInputError, match="unknown option"):
        async for _ in stream_tts(live_server.ws, TEXT, speed=2.0):
            pass
    with pytest.raises(InvalidInputError, match="non-empty"):
        synthesize(live_server.ws, "   ")
    junk = tmp_path / "voice.wav"
    junk.write_bytes(b"RIFF not really a wav file")
    with pytest.raises(AudioInputError):
        async for _ in stream_tts(live_server.ws, TEXT, reference=reference_from_file(junk, "Hi.")):
            pass


async def test_token_auth(server_factory):
    live = await server_factory("--max-frames", "10", "--token", "s3cret")
    with pytest.raises(ServerError) as err:
        async for _ in stream_tts(live.ws, TEXT):
            pass
    assert err.value.code == "unauthorized"
    pcm = b"".join([c async for c in stream_tts(live.ws, TEXT, token="s3cret", seed=1)])
    assert 0 < len(pcm) <= 10 * 960 * 2


def test_unreachable_server_is_a_typed_error():
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ClientConnectionError, match="cannot connect"):
        synthesize(f"ws://127.0.0.1:{port}/v1/tts/stream", TEXT)
    code = cli.main(["say", TEXT, "--url", f"ws://127.0.0.1:{port}/v1/tts/stream", "-o", "/dev/null"])
    assert code == 2


def _dead_url() -> str:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        return f"ws://127.0.0.1:{s.getsockname()[1]}/v1/tts/stream"


def test_say_leaves_no_wav_on_failure(tmp_path, capsys):
    out = tmp_path / "x.wav"
    assert cli.main(["say", TEXT, "--url", _dead_url(), "-o", str(out)]) == 2
    assert not out.exists()
    out.write_bytes(b"old")  # a file that was there is left as it was (it was deleted, found by a probe)
    assert cli.main(["say", TEXT, "--url", _dead_url(), "-o", str(out)]) == 2
    assert out.read_bytes() == b"old"
    ref = tmp_path / "me.wav"  # -o the reference recording itself: refused before anything is read or written
    ref.write_bytes(b"RIFF me")
    assert cli.main(["say", TEXT, "--url", _dead_url(), "-o", str(ref), "--reference-audio", str(ref),
                     "--reference-text", "Hi."]) == 2
    assert "same file" in capsys.readouterr().err and ref.read_bytes() == b"RIFF me"


async def test_say_server_error_removes_the_partial_wav(live_server, tmp_path):
    out = tmp_path / "x.wav"
    code = await asyncio.to_thread(cli.main, ["say", TEXT, "--url", live_server.ws, "-o", str(out),
                                              "--voice", "no-such-voice"])
    assert code == 2 and not out.exists()


def test_say_unwritable_output_is_one_line_error(tmp_path, capsys):
    code = cli.main(["say", TEXT, "--url", _dead_url(), "-o", str(tmp_path / "no" / "dir" / "x.wav")])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and err.count("\n") == 1 and "cannot write" in err, err


async def test_say_dash_writes_the_wav_to_stdout(live_server, tmp_path, monkeypatch):
    import io
    import sys

    class Stdout:
        buffer = io.BytesIO()

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdout", Stdout)
    code = await asyncio.to_thread(cli.main, ["say", TEXT, "--url", live_server.ws, "-o", "-",
                                              "--seed", str(SEED)])
    assert code == 0 and not (tmp_path / "-").exists()
    with wave.open(io.BytesIO(Stdout.buffer.getvalue()), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() > 0


def test_say_failure_keeps_a_device_output(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so that opening it for writing does not block
    try:
        assert cli.main(["say", TEXT, "--url", _dead_url(), "-o", str(fifo)]) == 2
        assert fifo.exists()  # not a regular file: left alone (as /dev/null must be)
    finally:
        os.close(reader)


@pytest.mark.parametrize("url", ["ws://127.0.0.1:99999/v1/tts/stream", "ws://h:abc/v1/tts/stream",
                                 "ws://[::1/v1/tts/stream"])
def test_say_bad_url_is_one_line_error(url, tmp_path, capsys):
    """Ports and hosts websockets cannot parse raised ValueError with a traceback (exit 1), found by a probe."""
    out = tmp_path / "x.wav"
    assert cli.main(["say", TEXT, "--url", url, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and not out.exists(), err


def test_say_refuses_a_pipe_before_writing(tmp_path, capsys):
    """A FIFO (or /dev/stdout on a pipe) cannot have its WAV header patched: refused at once with a hint, nothing
    written (wave raised 'Illegal seek' after 11.8 KB of a partial WAV had reached the reader)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert cli.main(["say", TEXT, "--url", _dead_url(), "-o", str(fifo)]) == 2
        err = capsys.readouterr().err
        assert "not seekable" in err and "-o -" in err and "Traceback" not in err, err
        assert os.read(reader, 1) == b""  # its writer came and went without a byte
    finally:
        os.close(reader)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
async def test_say_write_error_is_one_line_error(live_server, capsys):
    """/dev/full: every write fails with ENOSPC; an OSError traceback before (exit 1)."""
    code = await asyncio.to_thread(cli.main, ["say", TEXT, "--url", live_server.ws, "-o", "/dev/full",
                                              "--seed", str(SEED)])
    err = capsys.readouterr().err
    assert code == 2 and "cannot write /dev/full" in err and "Traceback" not in err, err


LONG_TEXT = " ".join([TEXT] * 40)  # many segments: still streaming long after its first audio


async def _first_audio(proc: asyncio.subprocess.Process, out: Path) -> None:
    """Until `say` (the subprocess) has written audio to `out`: a WAV header and at least one sample."""
    async with asyncio.timeout(60):
        while not (out.exists() and out.stat().st_size > 44):
            assert proc.returncode is None, "say ended before its first audio"
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
async def test_a_signal_mid_stream_removes_the_partial_wav_and_cancels_the_request(live_server, tmp_path, signum):
    """SIGTERM / SIGHUP left a truncated WAV with a valid header, SIGINT a KeyboardInterrupt traceback. Now each
    closes the connection (the server cancels the generation), removes the WAV, says so in one line and exits
    128 + the signal's number (130, 143, 129: the shell's code for death by it)."""
    out = tmp_path / "x.wav"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "higgs_stream.cli", "say", LONG_TEXT, "--url", live_server.ws, "-o", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        await _first_audio(proc, out)
        proc.send_signal(signum)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    name = signal.Signals(signum).name
    assert (proc.returncode, err.decode()) == (128 + signum, f"higgs-stream say: interrupted by {name}; partial "
                                                             f"output {out} removed\n")
    assert not out.exists()
    pipeline = live_server.state.pipeline
    async with asyncio.timeout(10):  # the server saw the connection close and cancelled the engine stream
        while pipeline.active or pipeline.engine.num_active:
            await asyncio.sleep(0.02)
    assert 'outcome="disconnected"' in live_server.state.metrics.render()  # it went away; it did not cancel



def test_a_second_signal_after_an_interruption_changes_nothing():
    """The first signal decides (`exiting`, as `say`'s CLI runs it): a SIGTERM 5-20 ms after the SIGINT had killed
    `say` with 143 by its default action once the handlers were gone (a probe). The second comes right after the
    interruption here, in a subprocess."""
    script = ("import asyncio, os, signal\n"
              "from higgs_stream.clients.client import Interrupted, until_interrupted\n"
              "async def main():\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    await asyncio.Event().wait()\n"
              "try:\n"
              "    asyncio.run(until_interrupted(main(), exiting=True))\n"
              "except Interrupted as e:\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    print(e.signum, signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)\n")
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, f"{int(signal.SIGINT)} True\n"), done.stderr

async def test_a_cancel_that_meets_a_message_is_not_lost():
    """The message and the cancel (a signal's) in one loop iteration: `asyncio.wait_for` (Python < 3.12) returned
    the message and dropped the cancel, and `say` streamed the whole utterance on after a SIGINT."""
    from higgs_stream.clients.client import _recv

    class Socket:
        def __init__(self) -> None:
            self.asked, self.message = asyncio.Event(), asyncio.get_running_loop().create_future()

        def recv(self) -> asyncio.Future:
            self.asked.set()
            return self.message

    ws = Socket()
    task = asyncio.ensure_future(_recv(ws, 60.0))
    await ws.asked.wait()
    ws.message.set_result("a chunk")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ws = Socket()
    task = asyncio.ensure_future(_recv(ws, 60.0))
    await ws.asked.wait()
    ws.message.set_result("a chunk")
    assert await task == "a chunk"
    with pytest.raises(TimeoutError):
        await _recv(Socket(), 0.01)


def test_an_interrupted_say_keeps_a_file_it_did_not_write(tmp_path):
    """`say` as a function, on the main thread: a SIGINT before the first audio is the loop's (no KeyboardInterrupt),
    raises Interrupted, and leaves `out`, there before, as it was (say had not opened it); the handlers were the
    call's only."""
    out = tmp_path / "x.wav"
    out.write_bytes(b"old")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    async def interrupted() -> Interrupted:
        from websockets.asyncio.server import serve

        asked = asyncio.Event()

        async def handler(ws):  # takes the request, never answers
            await ws.recv()
            asked.set()
            await ws.wait_closed()

        async with serve(handler, "127.0.0.1", 0) as server:
            url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/tts/stream"
            task = asyncio.ensure_future(until_interrupted(say(url, TEXT, out)))
            await asked.wait()
            os.kill(os.getpid(), signal.SIGINT)
            with pytest.raises(Interrupted) as e:
                await task
            return e.value

    assert threading.current_thread() is threading.main_thread()
    e = asyncio.run(interrupted())
    assert (e.signum, str(e), e.code) == (signal.SIGINT, "interrupted by SIGINT", "interrupted")
    assert out.read_bytes() == b"old"
    assert {s: signal.getsignal(s) for s in before} == before


async def test_until_interrupted_off_the_main_thread_installs_nothing():
    """`cli.main` in a worker thread (as these tests call it) cannot take signals: the coroutine just runs."""
    async def answer():
        return 42

    assert await asyncio.to_thread(lambda: asyncio.run(until_interrupted(answer()))) == 42


async def _hostile_server(replies):
    """A WebSocket server that answers the client's request with `replies` (then stays open, silent)."""
    from websockets.asyncio.server import serve

    async def handler(ws):
        await ws.recv()
        await ws.recv()  # the text and the end
        for r in replies:
            await ws.send(r)
        await ws.wait_closed()

    server = await serve(handler, "127.0.0.1", 0)
    return server, f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/tts/stream"


@pytest.mark.parametrize("replies, error, says", [
    (["not json"], ProtocolError, "not JSON"),
    (["[1, 2]"], ProtocolError, "JSON list"),
    (["[" * 100_000 + "]" * 100_000], ProtocolError, "not JSON"),  # RecursionError in the parser
    ([b"\x01\x02\x03"], ProtocolError, "odd PCM byte count"),
    (['{"type": "chunk", "context_id": "CID", "data": "@@@"}'], ProtocolError, "base64"),
    (['{"type": "chunk", "context_id": "CID"}'], ProtocolError, "base64"),
    ([b"\0" * (17 << 20)], ClientConnectionError, "dropped"),  # a frame past MAX_FRAME_BYTES: closed 1009
    ([], ClientConnectionError, "no message from .* for 0.5 s"),  # a server that never answers: the read timeout
])
async def test_a_hostile_server_raises_typed_errors(replies, error, says, monkeypatch):
    """Found by a probe: bad server messages were JSONDecodeError / AttributeError / KeyError / binascii.Error /
    RecursionError / AssertionError tracebacks, a 100 MB frame was taken whole and a silent server held the client
    forever. Now each is a typed error (ProtocolError, ClientConnectionError)."""
    import uuid

    monkeypatch.setattr(uuid, "uuid4", lambda: type("U", (), {"hex": "CID"})())
    server, url = await _hostile_server(replies)
    try:
        with pytest.raises(error, match=says):
            async for _ in stream_tts(url, "Hi.", read_timeout=0.5 if not replies else 60.0):
                pass
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("replies, error", [(["not json"], ProtocolError), ([], ClientConnectionError)])
async def test_the_blocking_client_raises_the_same_typed_errors(replies, error):
    server, url = await _hostile_server(replies)
    try:
        with pytest.raises(error):
            await asyncio.to_thread(synthesize, url, "Hi.", read_timeout=0.5)
    finally:
        server.close()
        await server.wait_closed()
