"""stream/encoders.py: each response_format, fed PCM in uneven pieces, decodes back (PyAV /
soundfile) to the fed duration within one codec frame, and is not silent."""

import io

import av
import numpy as np
import pytest
import soundfile as sf

from higgs_stream.stream.encoders import CONTENT_TYPES, FORMATS, RATES, Resampler, content_type, make_encoder

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


def encode(fmt: str, pcm: bytes, pieces: list[int], rate: int = RATE) -> tuple[bytes, int]:
    """Encoded bytes, and how many feeds returned bytes before the flush."""
    enc = make_encoder(fmt, rate)
    out, early, pos = [], 0, 0
    for n in pieces:
        chunk = enc.feed(pcm[pos:pos + 2 * n])
        early += bool(chunk)
        out.append(chunk)
        pos += 2 * n
    assert pos == len(pcm)
    out.append(enc.flush())
    return b"".join(out), early


def decode(fmt: str, data: bytes, want_rate: int = RATE) -> np.ndarray:
    """float mono samples at `want_rate`."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2") / 32768.0
    if fmt == "wav":
        wav, sr = sf.read(io.BytesIO(data), dtype="float32")
        assert sr == want_rate
        return wav
    with av.open(io.BytesIO(data)) as f:
        frames = [fr.to_ndarray().reshape(-1) for fr in f.decode(audio=0)]
        rate = f.streams.audio[0].rate
    wav = np.concatenate(frames).astype(np.float64)
    if np.issubdtype(frames[0].dtype, np.integer):
        wav /= 32768.0
    if rate != want_rate:  # opus decodes at 48 kHz
        assert fmt == "opus" and rate % want_rate == 0, (fmt, rate, want_rate)
        wav = wav[:: rate // want_rate]
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


PIECES = [1102, 960, 3840, 24000, 1, 12000, 4800, 4801, 999]  # what the server sends: a small first chunk, then more
TONES_HZ = (220.0, 1000.0, 3100.0)  # all below 8 kHz's Nyquist, so every rate keeps them


def tones(samples: int, rate: int) -> np.ndarray:
    t = np.arange(samples) / rate
    return sum(np.sin(2 * np.pi * f * t) for f in TONES_HZ) * 6000 / 32768  # peak < 0.55


@pytest.mark.parametrize("rate", [r for r in RATES if r != RATE])
def test_resampler_streams_what_a_one_shot_resample_gives(rate):
    """Fed in the server's uneven pieces, the resampler gives exactly what one call gives, its
    length within one sample of n · rate / 24000, and the tones the signal holds, at the new rate
    (vs the analytic tones: max |Δ| ≤ 1e-3 of peak away from the first and last 5 ms; measured
    0.6e-4 at 8 kHz to 1.05e-4 at 48 kHz)."""
    n = sum(PIECES)
    pcm = (tones(n, RATE) * 32768).astype("<i2").tobytes()
    whole = Resampler(rate)
    one_shot = whole.feed(pcm) + whole.flush()
    r, pieces, pos = Resampler(rate), [], 0
    for k in PIECES:
        pieces.append(r.feed(pcm[2 * pos:2 * (pos + k)]))
        pos += k
    pieces.append(r.flush())
    streamed = b"".join(pieces)
    assert streamed == one_shot
    # each piece gave audio at once (the 1-sample one may not)
    assert sum(bool(p) for p in pieces[:-1]) >= len(PIECES) - 1
    got = np.frombuffer(streamed, "<i2") / 32768
    assert abs(len(got) - n * rate / RATE) <= 1, (len(got), n * rate / RATE)
    edge = rate // 200
    want = tones(len(got), rate)
    err = np.abs(got - want)[edge:-edge].max() / np.abs(want).max()
    assert err <= 1e-3, f"{rate} Hz: max |Δ| {err:.2g} of peak"


@pytest.mark.parametrize("fmt", FORMATS)
def test_encoder_at_16_khz_decodes_back_to_the_fed_duration(fmt):
    rate, samples = 16000, sum(PIECES)
    data, early = encode(fmt, (tones(samples, RATE) * 32768).astype("<i2").tobytes(), PIECES, rate)
    wav = decode(fmt, data, rate)
    frame = {"mp3": 576, "aac": 1024, "opus": 320}.get(fmt, 0)  # the codec frame at 16 kHz
    priming = PRIMING.get(fmt, 0)
    assert abs(len(wav) - priming - samples * rate // RATE) <= frame + 1, (fmt, len(wav), samples * rate // RATE)
    rms = float(np.sqrt(np.mean(np.square(wav[rate // 10: -rate // 10]))))
    assert 0.2 < rms < 0.35, (fmt, rms)  # three tones of amplitude 6000/32768: rms 0.22
    assert early >= 5, f"{fmt}: streamed only {early} of {len(PIECES)} feeds before the flush"
    assert content_type(fmt, rate) == (f"audio/pcm;rate={rate};channels=1" if fmt == "pcm" else CONTENT_TYPES[fmt])
