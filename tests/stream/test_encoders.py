"""stream/encoders.py: each response_format, fed PCM in uneven pieces, decodes back (PyAV /
soundfile) to the fed duration within one codec frame, and is not silent."""

import io

import av
import numpy as np
import pytest
import soundfile as sf

from higgs_stream.stream.encoders import CONTENT_TYPES, FORMATS, make_encoder

RATE = 24000
# One codec frame at 24 kHz (MPEG-2 layer III 576, AAC 1024, opus 20 ms), the most the encoder may
# pad the end with; flac, wav and pcm are exact.
FRAME = {"mp3": 576, "aac": 1024, "opus": 480, "flac": 0, "wav": 0, "pcm": 0}
# Priming samples a decoder without gapless metadata plays first: LAME's encoder delay (576 + 529)
# and AAC's 1024; opus and flac streams carry theirs and the decoder drops it.
PRIMING = {"mp3": 1105, "aac": 1024}


def tone(samples: int) -> bytes:
    t = np.arange(samples) / RATE
    return (np.sin(2 * np.pi * 440 * t) * 8000).astype("<i2").tobytes()


def encode(fmt: str, pcm: bytes, pieces: list[int]) -> tuple[bytes, int]:
    """Encoded bytes, and how many feeds returned bytes before the flush."""
    enc = make_encoder(fmt)
    out, early, pos = [], 0, 0
    for n in pieces:
        chunk = enc.feed(pcm[pos:pos + 2 * n])
        early += bool(chunk)
        out.append(chunk)
        pos += 2 * n
    assert pos == len(pcm)
    out.append(enc.flush())
    return b"".join(out), early


def decode(fmt: str, data: bytes) -> np.ndarray:
    """float mono samples at 24 kHz."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2") / 32768.0
    if fmt == "wav":
        wav, sr = sf.read(io.BytesIO(data), dtype="float32")
        assert sr == RATE
        return wav
    with av.open(io.BytesIO(data)) as f:
        frames = [fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)]
        rate = f.streams.audio[0].rate
    wav = np.concatenate(frames).astype(np.float64)
    if np.issubdtype(frames[0].dtype, np.integer):
        wav /= 32768.0
    if rate != RATE:  # opus decodes at 48 kHz
        assert rate % RATE == 0
        wav = wav[:: rate // RATE]
    return wav


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoder_round_trip(fmt):
    samples = 3 * RATE + 777
    pieces = [1102, 960, 3840, 24000, 1, 12000] + [4800] * 7
    pieces.append(samples - sum(pieces))
    data, early = encode(fmt, tone(samples), pieces)
    wav = decode(fmt, data)
    assert abs(len(wav) - PRIMING.get(fmt, 0) - samples) <= FRAME[fmt], (fmt, len(wav), samples)
    rms = float(np.sqrt(np.mean(np.square(wav[RATE // 10: -RATE // 10]))))
    assert rms > 0.1, (fmt, rms)  # the tone's rms is 8000/32768/sqrt(2) = 0.17
    assert early >= 5, f"{fmt}: streamed only {early} of {len(pieces)} feeds before the flush"
    assert CONTENT_TYPES[fmt].startswith("audio/")


def test_encoder_without_audio_is_still_a_file():
    for fmt in ("mp3", "flac", "wav"):
        enc = make_encoder(fmt)
        assert isinstance(enc.flush(), bytes)
