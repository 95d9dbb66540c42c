"""Voice presets, aliases and inline references."""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import pytest
import soundfile as sf
from higgs_stream.engine.errors import AudioInputError, ConfigError, InvalidInputError, NotFoundError
from higgs_stream.stream.config import OPENAI_VOICES, ServerConfig
from higgs_stream.stream.errors import TooLargeError
from higgs_stream.stream.voices import VoiceLibrary


def tone(seconds: float, sr: int, channels: int = 1, fmt: str = "WAV") -> bytes:
    t = np.arange(int(seconds * sr)) / sr
    x = (0.25 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)
    if channels > 1:
        x = np.stack([x] * channels, axis=1)
    buf = io.BytesIO()
    sf.write(buf, x, sr, format=fmt)
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "belinda.wav").write_bytes(tone(0.5, 24000))
    (tmp_path / "belinda.txt").write_text("  Hello there.\n")
    (tmp_path / "nova.flac").write_bytes(tone(0.25, 48000, channels=2, fmt="FLAC"))
    (tmp_path / "nova.txt").write_text("Nova speaking.")
    (tmp_path / "notes.md").write_text("ignored: not audio")
    return tmp_path


def test_presets_and_aliases(folder):
    lib = VoiceLibrary(folder, {"house": "belinda"})
    b = lib.resolve("belinda")
    assert b.has_reference and b.transcript == "Hello there." and b.duration_s == 0.5
    wav, sr = b.decode()
    assert sr == 24000 and wav.dtype == np.float32 and wav.shape == (12000,)
    n = lib.resolve("nova")  # a preset named like an OpenAI voice wins over the alias
    assert n.name == "nova" and n.decode()[0].shape == (6000,)  # 48 kHz stereo -> 24 kHz mono
    assert lib.resolve("house") is b
    assert lib.resolve("alloy").name == "default" and not lib.resolve("alloy").has_reference
    assert set(OPENAI_VOICES) - {"nova"} <= set(lib.aliases)
    assert "nova" not in lib.aliases
    with pytest.raises(NotFoundError, match="unknown voice 'nobody'"):
        lib.resolve("nobody")
    with pytest.raises(InvalidInputError):
        lib.resolve(3)
    d = lib.describe()
    assert d["default"] == "default" and d["aliases"]["house"] == "belinda"
    assert [v["name"] for v in d["voices"]] == ["belinda", "nova"]
    assert d["voices"][0] == {"name": "belinda", "transcript": "Hello there.", "seconds": 0.5}


def test_default_preset(folder):
    (folder / "default.wav").write_bytes(tone(0.2, 24000))
    (folder / "default.txt").write_text("The default.")
    lib = VoiceLibrary(folder)
    assert lib.resolve("default").has_reference and lib.resolve("echo") is lib.resolve("default")


@pytest.mark.parametrize("setup, match", [
    (lambda d: (d / "x.wav").write_bytes(tone(0.2, 24000)), "no transcript"),
    (lambda d: ((d / "x.wav").write_bytes(b"garbage" * 10), (d / "x.txt").write_text("t")), "cannot decode"),
    (lambda d: ((d / "x.wav").write_bytes(tone(0.2, 8000)[:44] + bytes(3200)), (d / "x.txt").write_text("t")),
     "silent"),  # found by decoding: presets are decoded once at startup
    (lambda d: ((d / "x.wav").write_bytes(tone(0.2, 24000)), (d / "x.txt").write_text(" ")), "empty"),
    (lambda d: ((d / "bad name.wav").write_bytes(tone(0.2, 24000)), (d / "bad name.txt").write_text("t")), "name"),
])
def test_bad_presets_fail_at_startup(tmp_path, setup, match):
    setup(tmp_path)
    with pytest.raises(ConfigError, match=match):
        VoiceLibrary(tmp_path)


def _fifo(d):
    os.mkfifo(d / "x.wav")
    (d / "x.txt").write_text("t")


@pytest.mark.parametrize("setup, match", [
    (_fifo, "not a regular file"),  # read whole: start-up hung
    (lambda d: ((d / "x.wav").symlink_to("/dev/zero"), (d / "x.txt").write_text("t")), "not a regular file"),
    (lambda d: ((d / "x.wav").touch(), os.truncate(d / "x.wav", 6 << 30), (d / "x.txt").write_text("t")),
     "bytes, limit"),  # a sparse 6 GB file: read whole, memory grew without bound
    (lambda d: ((d / "x.wav").mkdir(), (d / "x.txt").write_text("t")), "not a regular file"),
    (lambda d: ((d / "x.wav").symlink_to(d / "x.wav"), (d / "x.txt").write_text("t")), "voice preset file"),  # loop
    (lambda d: ((d / "x.wav").symlink_to(d / "gone.wav"), (d / "x.txt").write_text("t")), "voice preset file"),
    (lambda d: ((d / "x.wav").write_bytes(tone(0.2, 24000)), (d / "x.txt").write_bytes("café".encode("latin-1"))),
     "not UTF-8"),
    (lambda d: ((d / "x.wav").write_bytes(tone(0.2, 24000)), (d / "x.txt").write_text("t" * 2001)), "2001 chars"),
    (lambda d: ((d / "x.wav").write_bytes(tone(0.2, 24000)), (d / "x.txt").write_text("t" * 200_000)), "bytes, limit"),
])
def test_preset_files_are_checked_before_they_are_read(tmp_path, setup, match):
    """Each was found by a probe: a hang, unbounded memory, or a traceback at start-up; now one ConfigError."""
    setup(tmp_path)
    with pytest.raises(ConfigError, match=match):
        VoiceLibrary(tmp_path)


def test_a_transcript_s_byte_order_mark_is_dropped(folder):
    (folder / "belinda.txt").write_bytes("\ufeffHello there.".encode("utf-8"))
    assert VoiceLibrary(folder).resolve("belinda").transcript == "Hello there."


def test_bad_config(folder):
    with pytest.raises(ConfigError, match="no preset"):
        VoiceLibrary(folder, {"alloy": "ghost"})
    with pytest.raises(ConfigError, match="shadows"):
        VoiceLibrary(folder, {"belinda": "nova"})
    with pytest.raises(ConfigError, match="does not exist"):
        VoiceLibrary(folder / "missing")


def test_inline_reference():
    """inline() reads the file's header only; decoding (and what only decoding finds) comes later."""
    lib = VoiceLibrary.from_config(ServerConfig(max_reference_bytes=100_000, max_reference_s=2.0))
    data = tone(0.5, 16000)
    v = lib.inline(base64.b64encode(data).decode(), " clip text ")
    assert v.transcript == "clip text" and v.duration_s == 0.5 and v.audio == data
    wav, sr = v.decode()
    assert wav.shape == (12000,) and sr == 24000
    assert lib.inline("data:audio/wav;base64," + base64.b64encode(data).decode(), "clip text").key == v.key
    assert lib.inline(base64.b64encode(data).decode(), "other text").key != v.key
    with pytest.raises(AudioInputError, match="base64"):
        lib.inline("@@@@", "t")
    with pytest.raises(AudioInputError, match="cannot decode"):
        lib.inline(base64.b64encode(b"RIFF0000WAVEjunk").decode(), "t")
    with pytest.raises(AudioInputError, match="too long"):
        lib.inline(base64.b64encode(tone(2.5, 8000)).decode(), "t")
    silent = lib.inline(base64.b64encode(tone(0.5, 8000)[:44] + bytes(8000)).decode(), "t")
    with pytest.raises(AudioInputError, match="silent"):
        silent.decode()
    with pytest.raises(TooLargeError):
        lib.inline(base64.b64encode(bytes(200_000)).decode(), "t")
    with pytest.raises(InvalidInputError, match="transcript"):
        lib.inline(base64.b64encode(data).decode(), "  ")


def test_inline_reference_is_not_decoded(monkeypatch, flac_announcing):
    """A compressed file announcing an hour of audio is refused from its header, before decoding."""
    lib = VoiceLibrary.from_config(ServerConfig())
    monkeypatch.setattr(sf.SoundFile, "read", lambda *a, **k: pytest.fail("inline() decoded audio"))
    v = lib.inline(base64.b64encode(flac_announcing(4800)).decode(), "t")
    assert v.duration_s == pytest.approx(0.1)
    with pytest.raises(AudioInputError, match="announces 3600.00 s > 30 s"):
        lib.inline(base64.b64encode(flac_announcing(3600 * 48000)).decode(), "t")


def test_model_speakers_are_voices(tmp_path):
    """A model's built-in speakers resolve by name in any case; a preset of the same name wins; OpenAI
    names stay aliases of `default` unless a speaker takes the name."""
    (tmp_path / "dylan.wav").write_bytes(tone(0.5, 16000))
    (tmp_path / "dylan.txt").write_text("Hi, I am the preset Dylan.")
    lib = VoiceLibrary(tmp_path, speakers=("aiden", "Dylan", "nova"))
    assert lib.resolve("AIDEN").speaker == "aiden" and not lib.resolve("aiden").has_reference
    assert lib.resolve("dylan").has_reference and lib.resolve("dylan").speaker is None  # the preset
    assert lib.resolve("nova").speaker == "nova" and "nova" not in lib.aliases
    assert lib.resolve("alloy") is lib.default and lib.default.speaker is None  # the model's own default
    assert lib.describe()["speakers"] == ["aiden", "nova"] and {"aiden", "nova", "dylan"} <= set(lib.names())
    with pytest.raises(NotFoundError, match="unknown voice"):
        lib.resolve("vivian")
    assert VoiceLibrary(None, {"calm": "aiden"}, speakers=("aiden",)).resolve("calm").speaker == "aiden"
    with pytest.raises(ConfigError, match="shadows a preset or speaker"):
        VoiceLibrary(None, {"aiden": "default"}, speakers=("aiden",))


def test_names_resolve_in_any_case_and_list_in_their_own(folder):
    """Users type "Nova" or "ALLOY" (OpenAI's clients send lower case): every name matches in any case."""
    (folder / "Kate.wav").write_bytes(tone(0.2, 24000))
    (folder / "Kate.txt").write_text("Kate here.")
    lib = VoiceLibrary(folder, {"House": "BELINDA", "Alloy": "nova"}, speakers=("Aiden", "kate"))
    nova, kate = lib.resolve("nova"), lib.resolve("Kate")
    assert lib.resolve("Nova") is nova and lib.resolve("NOVA") is nova and nova.name == "nova"
    assert lib.resolve("kate") is kate and lib.resolve("KATE") is kate and kate.name == "Kate" and kate.has_reference
    assert lib.resolve("AIDEN").speaker == "aiden" and "kate" not in lib.speakers  # the preset wins, in any case
    assert lib.resolve("house") is lib.resolve("HOUSE") is lib.resolve("belinda")
    assert lib.resolve("alloy") is nova and lib.resolve("ALLOY") is nova  # the configured alias replaced OpenAI's
    assert lib.resolve("Echo") is lib.resolve("DEFAULT") is lib.default and not lib.default.has_reference
    assert lib.aliases["House"] == "belinda" and lib.aliases["Alloy"] == "nova" and "alloy" not in lib.aliases
    assert lib.names() == sorted({"Alloy", "House", "Kate", "aiden", "belinda", "default", "nova",
                                  *(set(OPENAI_VOICES) - {"alloy", "nova"})})
    d = lib.describe()
    assert [v["name"] for v in d["voices"]] == ["Kate", "belinda", "nova"] and d["speakers"] == ["aiden"]
    assert d["aliases"]["House"] == "belinda" and d["aliases"]["Alloy"] == "nova"
    with pytest.raises(NotFoundError) as e:
        lib.resolve("Nobody")
    assert str(e.value) == "unknown voice 'Nobody'; known: " + ", ".join(lib.names())


def test_names_compare_by_unicode_case_folding(folder):
    """str.lower() left "STRASSE" unknown beside an alias "straße" (a probe); case folding after NFKC matches it and
    the Kelvin sign is a K (Unicode's default folding: not Turkish-aware, so dotted İ stays apart from I)."""
    lib = VoiceLibrary(folder, {"straße": "nova", "kate": "belinda", "İzmir": "nova"})
    nova, belinda = lib.resolve("nova"), lib.resolve("belinda")
    assert lib.resolve("STRASSE") is lib.resolve("Strasse") is lib.resolve("STRAßE") is nova
    assert lib.resolve("\u212aATE") is belinda  # KELVIN SIGN + ATE
    assert lib.resolve("İzmir") is nova
    with pytest.raises(NotFoundError):
        lib.resolve("Izmir")
    with pytest.raises(ConfigError, match="differ only by case"):
        VoiceLibrary(folder, {"strasse": "nova", "STRAßE": "belinda"})

def test_a_preset_named_default_in_any_case_is_the_default(folder):
    (folder / "Default.wav").write_bytes(tone(0.2, 24000))
    (folder / "Default.txt").write_text("The default.")
    lib = VoiceLibrary(folder)
    assert lib.default is lib.presets["Default"] and lib.resolve("default") is lib.default
    assert lib.resolve("DEFAULT") is lib.default and lib.resolve("onyx") is lib.default
    assert "Default" in lib.names() and "default" not in lib.names()


@pytest.mark.parametrize("setup, aliases, match", [
    (lambda d: ((d / "Nova.wav").write_bytes(tone(0.2, 24000)), (d / "Nova.txt").write_text("t")), {},
     "voice presets 'Nova' and 'nova' in .* differ only by case"),
    (lambda d: ((d / "BELINDA.ogg").write_bytes(tone(0.2, 24000, fmt="OGG")), (d / "BELINDA.txt").write_text("t")),
     {}, "voice presets 'BELINDA' and 'belinda' in .* differ only by case"),
    (lambda d: None, {"House": "belinda", "house": "nova"}, "voice aliases 'House' and 'house' differ only by case"),
    (lambda d: None, {"Belinda": "nova"}, "voice alias 'Belinda' shadows a preset or speaker of the same name "
                                          r"\('belinda': voice names are case-insensitive\)"),
    (lambda d: None, {"house": "Ghost"}, "no preset or speaker named 'Ghost'"),
])
def test_names_that_differ_only_by_case_fail_at_startup(folder, setup, aliases, match):
    setup(folder)
    with pytest.raises(ConfigError, match=match):
        VoiceLibrary(folder, aliases)


def test_transcripts_are_checked_with_the_given_check(folder):
    """`check_transcripts` runs the engine's control-token check (stream/serve_command.py passes
    `engine.check_transcript`) on every preset and names the file of the first it refuses."""
    (folder / "nova.txt").write_text("Nova <|eot_id|> speaking.")
    lib = VoiceLibrary(folder)
    seen = []

    def check(transcript: str) -> None:
        seen.append(transcript)
        if "<|" in transcript:
            raise InvalidInputError("transcript contains chat/audio control tokens (ids [128009]); remove them")

    with pytest.raises(ConfigError) as e:
        lib.check_transcripts(check)
    assert str(e.value) == (f"voice preset {folder / 'nova.txt'}: transcript contains chat/audio control tokens "
                            f"(ids [128009]); remove them")
    assert seen == ["Hello there.", "Nova <|eot_id|> speaking."]
    (folder / "nova.txt").write_text("Nova speaking.")
    seen.clear()
    VoiceLibrary(folder).check_transcripts(check)  # every preset passes: nothing raised
    assert seen == ["Hello there.", "Nova speaking."]
