"""load_reference_audio / validate_waveform: formats, downmix + resampling to 24 kHz, typed rejections."""

import io

import numpy as np
import pytest
import soundfile as sf
from higgs_stream.engine.codec import (
    load_reference_audio,
    prepare_waveform,
    probe_reference_audio,
    validate_waveform,
)
from higgs_stream.engine.codec.audio_io import resample_problem, to_codec_rate
from higgs_stream.engine.errors import AudioInputError


def sine(freq: float, sr: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def encoded(wav_tc: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, wav_tc, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def test_stereo_44k1_wav_becomes_the_mono_24k_sine():
    left, right = sine(440, 44100, 0.5, 0.6), sine(440, 44100, 0.5, 0.2)
    data = encoded(np.stack([left, right], axis=1), 44100, "WAV", "FLOAT")
    wav, sr = load_reference_audio(data)
    assert sr == 24000 and wav.dtype == np.float32 and wav.ndim == 1
    assert wav.shape[0] == int(np.ceil(len(left) * 24000 / 44100))
    expected = sine(440, 24000, 0.5, 0.4)[: wav.shape[0]]  # channel mean of 0.6 and 0.2 amplitude
    inner = slice(200, -200)  # resampling filter edges
    assert np.abs(wav[inner] - expected[inner]).max() < 2e-3


@pytest.mark.parametrize("fmt,subtype", [("FLAC", "PCM_16"), ("OGG", "VORBIS"), ("WAV", "PCM_16")])
def test_formats_from_path_and_bytes(tmp_path, fmt, subtype):
    src = sine(300, 16000, 0.4)
    data = encoded(src, 16000, fmt, subtype)
    path = tmp_path / f"ref.{fmt.lower()}"
    path.write_bytes(data)
    from_bytes, _ = load_reference_audio(data)
    from_path, sr = load_reference_audio(path)
    assert sr == 24000 and np.array_equal(from_bytes, from_path)
    expected = sine(300, 24000, 0.4)[: from_path.shape[0]]
    tol = 0.05 if fmt == "OGG" else 2e-3  # lossy codec
    assert np.abs(from_path[200:-200] - expected[200:-200]).max() < tol


def test_24k_mono_passes_through_unchanged():
    src = sine(500, 24000, 0.3)
    wav, _ = load_reference_audio(encoded(src, 24000, "WAV", "FLOAT"))
    assert np.array_equal(wav, src)


@pytest.mark.parametrize("make,match", [
    (lambda: b"", "empty"),
    (lambda: b"RIFF\x00\x00garbage-not-audio" * 10, "cannot decode"),
    (lambda: encoded(np.zeros(24000, np.float32), 24000, "WAV", "FLOAT"), "silent"),
    (lambda: encoded(sine(440, 8000, 0.02), 8000, "WAV", "FLOAT"), "too short"),
    (lambda: encoded(sine(440, 8000, 31.0), 8000, "WAV", "PCM_16"), "too long"),
    (lambda: 12345, "bytes or a path"),
    (lambda: "/nonexistent/ref.wav", "not found"),
])
def test_rejections_are_typed(make, match):
    with pytest.raises(AudioInputError, match=match):
        load_reference_audio(make())


def test_max_seconds_is_configurable():
    data = encoded(sine(440, 8000, 3.0), 8000, "WAV", "PCM_16")
    assert load_reference_audio(data, max_seconds=5)[0].shape == (72000,)
    with pytest.raises(AudioInputError, match="too long"):
        load_reference_audio(data, max_seconds=2.5)


def test_length_is_checked_from_the_header_before_decoding(monkeypatch, flac_announcing):
    assert probe_reference_audio(flac_announcing(4800)) == pytest.approx(0.1)
    assert load_reference_audio(flac_announcing(4800))[0].shape == (2400,)
    bomb, unknown = flac_announcing(3600 * 48000), flac_announcing(0)  # 1 h; a length left unknown
    monkeypatch.setattr(sf.SoundFile, "read", lambda *a, **k: pytest.fail("decoded a refused file"))
    for data, match in ((bomb, "announces 3600.00 s > 30 s"), (unknown, "too long")):
        with pytest.raises(AudioInputError, match=match):
            probe_reference_audio(data)
        with pytest.raises(AudioInputError, match=match):
            load_reference_audio(data)
    with pytest.raises(AudioInputError, match="cannot decode"):
        probe_reference_audio(b"RIFF\x00\x00garbage-not-audio" * 10)


def test_validate_waveform_shapes_and_integer_pcm():
    pcm16 = (sine(440, 24000, 0.1) * 32767).astype(np.int16)
    out = validate_waveform(pcm16, 24000)
    assert out.shape == (1, 2400) and out.dtype == np.float32
    assert abs(float(out.max()) - 0.5) < 1e-3  # int16 full scale -> 1.0
    with pytest.raises(AudioInputError, match="channel-first"):
        validate_waveform(np.ones((2400, 2), np.float32), 24000)  # [T, C] by mistake
    with pytest.raises(AudioInputError, match="NaN"):
        validate_waveform(np.full(2400, np.nan, np.float32), 24000)
    with pytest.raises(AudioInputError, match="signed-integer"):
        validate_waveform(np.full(2400, 200, np.uint8), 24000)
    with pytest.raises(AudioInputError, match="sample rate"):
        validate_waveform(np.ones(2400, np.float32), 0)
    stereo = np.stack([sine(440, 48000, 0.1), -sine(440, 48000, 0.1) + 0.2])
    np.testing.assert_allclose(prepare_waveform(stereo, 48000)[100:-100], 0.1, atol=2e-3)


@pytest.mark.parametrize("data", [b"junk" * 50, b"RIFFjunkWAVE" * 9, b"ID3\x04" + bytes(300)])
def test_undecodable_audio_says_what_is_wrong_without_internals(data):
    for load in (probe_reference_audio, load_reference_audio):
        with pytest.raises(AudioInputError) as e:
            load(data)
        message = str(e.value)
        assert "0x" not in message and "BytesIO" not in message and "<_io" not in message, message
        assert "cannot decode audio" in message and "not a WAV, FLAC, OGG or MP3 file" in message, message


@pytest.mark.parametrize("rate", [23999, 44101, 7919])
def test_a_rate_whose_resampling_costs_too_much_is_refused_from_its_header(rate, monkeypatch):
    """23999 Hz (2 s, 96 KB) took 10 GB and 29 s in torchaudio's resampler, 44101 Hz 18 GB (a probe): refused from the
    header, before any sample is decoded (the resampler is never called)."""
    import torchaudio

    monkeypatch.setattr(torchaudio.functional, "resample", lambda *a, **k: pytest.fail("resampled"))
    buf = io.BytesIO()
    sf.write(buf, 0.3 * np.sin(np.arange(2 * rate) / 10.0), rate, format="WAV")
    with pytest.raises(AudioInputError, match=f"sample rate {rate} Hz is not supported"):
        load_reference_audio(buf.getvalue())
    with pytest.raises(AudioInputError, match="not supported"):
        to_codec_rate(np.zeros((1, 2 * rate), np.float32), rate)


@pytest.mark.parametrize("rate", [8000, 11025, 16000, 22050, 32000, 44100, 48000, 88200, 96000])
def test_common_rates_resample(rate):
    assert resample_problem(rate) is None and resample_problem(rate, 16000) is None
