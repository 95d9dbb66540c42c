"""Reference-audio intake: decode (soundfile), validate, downmix and resample to the codec rate.

Every user-caused problem (undecodable, empty, silent, too short, too long, non-finite) is an
AudioInputError with a message saying which.
"""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np
import torch
from higgs_stream.engine.errors import AudioInputError

CODEC_SAMPLE_RATE = 24000
DEFAULT_MAX_SECONDS = 30.0
MIN_SECONDS = 0.04  # one codec frame
SILENCE_PEAK = 1e-4  # -80 dBFS: a peak below this is treated as silence
MAX_CHANNELS = 16
# torchaudio's sinc resampler builds a kernel of (rate / gcd) phases: 23999 -> 24000 Hz (gcd 1) took 10 GB and 29 s
# for 2 s of audio, 44101 Hz 18 GB (a probe, one 96 KB upload); every common rate reduces to <= 400 against 24 kHz
# (44.1 kHz: 147 / 80) or 16 kHz
MAX_RESAMPLE_TERM = 1000


def validate_waveform(wav: np.ndarray, sr: int, max_seconds: float = DEFAULT_MAX_SECONDS) -> np.ndarray:
    """Checks a [T] or channel-first [C, T] waveform; returns it as float32 [C, T]."""
    if not isinstance(sr, (int, np.integer)) or isinstance(sr, bool) or sr <= 0:
        raise AudioInputError(f"sample rate must be a positive int, got {sr!r}")
    a = np.asarray(wav)
    if a.dtype.kind not in "fi":
        raise AudioInputError(f"audio samples must be float or signed-integer PCM, got dtype {a.dtype}")
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[0] > MAX_CHANNELS:
        raise AudioInputError(f"audio must be [T] or channel-first [C, T] with C <= {MAX_CHANNELS}, "
                              f"got shape {tuple(np.shape(wav))}")
    if a.dtype.kind == "i":  # signed integer PCM -> [-1, 1)
        a = a.astype(np.float32) / float(2 ** (8 * a.dtype.itemsize - 1))
    a = a.astype(np.float32, copy=False)
    n = a.shape[1]
    if n == 0 or a.shape[0] == 0:
        raise AudioInputError("audio is empty")
    seconds = n / sr
    if seconds < MIN_SECONDS:
        raise AudioInputError(f"audio is too short: {seconds * 1000:.1f} ms < {MIN_SECONDS * 1000:.0f} ms")
    if seconds > max_seconds:
        raise AudioInputError(f"audio is too long: {seconds:.2f} s > {max_seconds:g} s")
    if not np.isfinite(a).all():
        raise AudioInputError("audio contains NaN or infinite samples")
    if float(np.abs(a).max()) < SILENCE_PEAK:
        raise AudioInputError("audio is silent")
    return a


def resample_problem(sr: int, target_sr: int = CODEC_SAMPLE_RATE) -> str | None:
    """Why `sr` cannot be resampled to `target_sr` at a bounded cost (None: it can; MAX_RESAMPLE_TERM)."""
    g = math.gcd(int(sr), int(target_sr))
    if max(int(sr) // g, int(target_sr) // g) > MAX_RESAMPLE_TERM:
        return (f"sample rate {sr} Hz is not supported (resampling it to {target_sr} Hz costs too much); use a common "
                f"rate such as 8000, 16000, 22050, 24000, 32000, 44100 or 48000 Hz")
    return None


def to_codec_rate(wav: np.ndarray, sr: int, target_sr: int = CODEC_SAMPLE_RATE) -> np.ndarray:
    """float32 [C, T] at sr -> mono float32 [T'] at target_sr (channel mean, torchaudio sinc resampling);
    AudioInputError for a rate whose resampling would cost too much (`resample_problem`)."""
    import torchaudio

    problem = resample_problem(sr, target_sr)
    if problem is not None:
        raise AudioInputError(problem)
    mono = torch.from_numpy(np.ascontiguousarray(wav.mean(axis=0, dtype=np.float32)))  # [T]
    if sr != target_sr:
        mono = torchaudio.functional.resample(mono, int(sr), target_sr)
    return mono.numpy().astype(np.float32, copy=False)


def prepare_waveform(wav: np.ndarray, sr: int, max_seconds: float = DEFAULT_MAX_SECONDS,
                     target_sr: int = CODEC_SAMPLE_RATE) -> np.ndarray:
    """Validate then downmix/resample: any [T] / [C, T] at any rate -> mono float32 [T'] at target_sr."""
    return to_codec_rate(validate_waveform(wav, sr, max_seconds), sr, target_sr)


def _source(source: bytes | bytearray | memoryview | str | Path) -> tuple[io.BytesIO | str, str]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise AudioInputError("audio is empty (0 bytes)")
        return io.BytesIO(bytes(source)), f"<{len(source)} bytes>"
    if isinstance(source, (str, Path)):
        if not Path(source).is_file():
            raise AudioInputError(f"audio file not found: {source}")
        return str(source), str(source)
    raise AudioInputError(f"audio must be bytes or a path, got {type(source).__name__}")


def _decode_problem(e: Exception) -> str:
    """What a decoder's exception says is wrong with the file, without the Python objects in its
    text: libsndfile's "Error opening <_io.BytesIO object at 0x7f...>: " prefix is an address, its
    `error_string` ("Format not recognised.") the reason."""
    detail = getattr(e, "error_string", None) or str(e)
    detail = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the file", detail).strip().rstrip(".:")
    return detail or type(e).__name__


def _open_checked(source, max_seconds: float):
    """An open soundfile.SoundFile whose header announces 1 … max_seconds of audio and at most
    MAX_CHANNELS channels. Reads the header only: a file is refused before any sample is decoded."""
    import soundfile as sf

    handle, name = _source(source)
    try:
        f = sf.SoundFile(handle)
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        raise AudioInputError(f"cannot decode audio {name}: not a WAV, FLAC, OGG or MP3 file that libsndfile "
                              f"can read ({_decode_problem(e)})") from e
    problem = None
    if f.samplerate <= 0 or f.channels <= 0:
        problem = f"header has sample rate {f.samplerate} and {f.channels} channels"
    elif f.channels > MAX_CHANNELS:
        problem = f"audio has {f.channels} channels, limit {MAX_CHANNELS}"
    elif f.frames <= 0:
        problem = "audio is empty"
    elif f.frames / f.samplerate > max_seconds:  # also a length the header leaves unknown (2**63 - 1)
        problem = f"audio is too long: the header announces {f.frames / f.samplerate:.2f} s > {max_seconds:g} s"
    else:  # refused from its header: before any sample is decoded
        problem = resample_problem(f.samplerate)
    if problem is not None:
        f.close()
        raise AudioInputError(problem)
    return f


def probe_reference_audio(source: bytes | bytearray | memoryview | str | Path,
                          max_seconds: float = DEFAULT_MAX_SECONDS) -> float:
    """Seconds of audio a WAV/FLAC/OGG file announces in its header, checked against `max_seconds`
    without decoding it (cheap enough for an event loop); AudioInputError when refused."""
    with _open_checked(source, max_seconds) as f:
        return f.frames / f.samplerate


def load_reference_audio(source: bytes | bytearray | memoryview | str | Path,
                         max_seconds: float = DEFAULT_MAX_SECONDS) -> tuple[np.ndarray, int]:
    """WAV/FLAC/OGG bytes or a file path -> (mono float32 [T] at 24 kHz, 24000).

    The header is checked first (`probe_reference_audio`) and no more frames than it announces are
    decoded, so a small compressed file cannot expand to hours of audio."""
    import soundfile as sf

    with _open_checked(source, max_seconds) as f:
        try:
            data = f.read(dtype="float32", always_2d=True)  # [T, C], T <= the announced frames
        except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
            raise AudioInputError(f"cannot decode audio: the file is corrupt ({_decode_problem(e)})") from e
        sr = f.samplerate
    return prepare_waveform(data.T, int(sr), max_seconds), CODEC_SAMPLE_RATE
