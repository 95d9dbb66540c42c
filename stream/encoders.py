"""Incremental audio encoders for `POST /v1/audio/speech` (stream/PROTOCOL.md §2): one object per
request, fed 24 kHz mono s16le PCM as it arrives, returning the encoded bytes ready so far;
`flush()` returns the rest. mp3, opus (in Ogg), aac (ADTS) and flac are encoded by PyAV (FFmpeg's
libmp3lame, libopus, aac and flac encoders); wav is a header of unknown length and the PCM; pcm
is the PCM itself. A response at another sample rate (`RATES`) passes through a `Resampler`
(FFmpeg's libswresample) before its encoder, chunk by chunk. No I/O: the HTTP driver writes what
these return.

Cost, measured on the 2-core CPU box (2026-11-26), per second of audio: mp3 10.8 ms, aac 4.4 ms,
opus 3.6 ms, flac 0.4 ms; resampling 0.2 ms (to 16 kHz) to 0.55 ms (to 48 kHz). The driver calls
`feed` on the event loop (a chunk is ≤ 1 s, so one call blocks it ≤ ~11 ms); moving it to a thread
needs `close` to wait for a running `feed`.
"""

from __future__ import annotations

import struct

import numpy as np

from higgs_stream.stream.config import SAMPLE_RATE

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
# Sample rates a response may have: the codec's own and the rates voice pipelines and telephony run
# at. Opus has no 22.05 / 44.1 kHz mode.
RATES = (8000, 16000, 22050, 24000, 44100, 48000)
OPUS_RATES = (8000, 16000, 24000, 48000)
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg; codecs=opus", "aac": "audio/aac", "flac": "audio/flac",
                 "wav": "audio/wav", "pcm": f"audio/pcm;rate={SAMPLE_RATE};channels=1"}
# format -> (FFmpeg muxer, encoder, muxer options). Ogg pages are cut every 20 ms (default 1 s) so
# opus streams as it is encoded.
_AV = {"mp3": ("mp3", "libmp3lame", {}), "opus": ("ogg", "libopus", {"page_duration": "20000"}),
       "aac": ("adts", "aac", {}), "flac": ("flac", "flac", {})}


def wav_header(sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 44-byte PCM s16 mono WAV header with unknown length (RIFF and data sizes 0xFFFFFFFF)."""
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def rates_for(fmt: str) -> tuple[int, ...]:
    """The sample rates `fmt` can be encoded at."""
    return OPUS_RATES if fmt == "opus" else RATES


def content_type(fmt: str, sample_rate: int = SAMPLE_RATE) -> str:
    if fmt == "pcm":
        return f"audio/pcm;rate={sample_rate};channels=1"
    return CONTENT_TYPES[fmt]


class PcmEncoder:
    """Raw s16le; `wav` puts the streaming WAV header in front."""

    def __init__(self, wav: bool = False, sample_rate: int = SAMPLE_RATE):
        self._head = wav_header(sample_rate) if wav else b""

    def feed(self, pcm: bytes) -> bytes:
        head, self._head = self._head, b""
        return head + pcm

    def flush(self) -> bytes:
        return self.feed(b"")

    def close(self) -> None:
        pass


class _Sink:
    """The file object PyAV's muxer writes into; the encoder takes what it wrote after each call."""

    def __init__(self):
        self.buf = bytearray()

    def write(self, data) -> int:
        self.buf += data
        return len(data)

    def take(self) -> bytes:
        data = bytes(self.buf)
        self.buf.clear()
        return data


class AvEncoder:
    """mp3 / opus / aac / flac through PyAV. PyAV regroups the fed samples into the codec's frame size."""

    def __init__(self, fmt: str, sample_rate: int = SAMPLE_RATE):
        import av  # through aiortc; imported here so the PCM paths do not need it

        muxer, codec, options = _AV[fmt]
        self._av = av
        self._sink = _Sink()
        # A small I/O buffer: the muxer's output reaches the client as each packet is written.
        self._out = av.open(self._sink, "w", format=muxer, options=options, buffer_size=4096)
        self._stream = self._out.add_stream(codec, rate=sample_rate, layout="mono")
        self._rate = sample_rate
        self._pts = 0
        self._closed = False

    def feed(self, pcm: bytes) -> bytes:
        assert len(pcm) % 2 == 0, "s16 PCM has an even byte count"
        assert not self._closed, "feed after flush"
        if pcm:
            samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)  # [1, S]
            frame = self._av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate = self._rate
            frame.pts = self._pts
            self._pts += frame.samples
            for packet in self._stream.encode(frame):
                self._out.mux(packet)
        return self._sink.take()

    def flush(self) -> bytes:
        if not self._closed:
            self._closed = True
            for packet in self._stream.encode(None):
                self._out.mux(packet)
            self._out.close()
        return self._sink.take()

    def close(self) -> None:
        """Drop an unfinished encode (the client left); frees the FFmpeg contexts."""
        if not self._closed:
            self._closed = True
            self._out.close()


class Resampler:
    """24 kHz mono s16le in, `rate` out, chunk by chunk (FFmpeg's libswresample through PyAV).

    The filter holds back a few samples (under 1 ms) between calls; `flush()` returns them. Fed in
    any pieces, the output equals resampling the whole at once, and its length is within one
    sample of n · rate / 24000 for n samples fed (tests/stream/test_encoders.py)."""

    def __init__(self, rate: int):
        import av

        self._av = av
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
        self._pts = 0

    def feed(self, pcm: bytes) -> bytes:
        assert len(pcm) % 2 == 0, "s16 PCM has an even byte count"
        if not pcm:
            return b""
        frame = self._av.AudioFrame.from_ndarray(np.frombuffer(pcm, dtype="<i2").reshape(1, -1),  # [1, S]
                                                 format="s16", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        frame.pts = self._pts
        self._pts += frame.samples
        return self._take(self._resampler.resample(frame))

    def flush(self) -> bytes:
        return self._take(self._resampler.resample(None))

    @staticmethod
    def _take(frames) -> bytes:
        return b"".join(f.to_ndarray().astype("<i2", copy=False).tobytes() for f in frames)  # each [1, S]


class ResampledEncoder:
    """An encoder at another sample rate, fed 24 kHz PCM like every encoder here."""

    def __init__(self, encoder: PcmEncoder | AvEncoder, rate: int):
        self._encoder = encoder
        self._resampler = Resampler(rate)

    def feed(self, pcm: bytes) -> bytes:
        return self._encoder.feed(self._resampler.feed(pcm))

    def flush(self) -> bytes:
        return self._encoder.feed(self._resampler.flush()) + self._encoder.flush()

    def close(self) -> None:
        self._encoder.close()


Encoder = PcmEncoder | AvEncoder | ResampledEncoder


def make_encoder(fmt: str, sample_rate: int = SAMPLE_RATE) -> Encoder:
    assert fmt in FORMATS, f"unknown response_format {fmt!r}"
    assert sample_rate in rates_for(fmt), f"{fmt} at {sample_rate} Hz is not offered"
    encoder = AvEncoder(fmt, sample_rate) if fmt in _AV else PcmEncoder(wav=fmt == "wav", sample_rate=sample_rate)
    return encoder if sample_rate == SAMPLE_RATE else ResampledEncoder(encoder, sample_rate)
