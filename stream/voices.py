"""Voices: preset reference clips from a folder, the model's built-in speakers, OpenAI voice names
as aliases, inline references.

A preset is `DIR/NAME.wav` (or .flac/.ogg) plus `DIR/NAME.txt` holding its transcript. A speaker is
one of the checkpoint's built-in voices (Qwen3-TTS CustomVoice); a preset of the same name wins. Every
name (preset, speaker, alias, `default`) is looked up case-insensitively ("Nova" is "nova") and listed
in its own spelling; two presets or aliases whose names differ only by case are a ConfigError.
`default` is the preset of that name if present, else the model's own voice (no reference; a model
with speakers uses its default speaker). OpenAI's voice names resolve to a preset or speaker of the
same name, else to a configured alias, else to `default`
(stream/PROTOCOL.md §2.4). This module only finds audio files and checks their headers, which is
cheap enough for the event loop; decoding (`Voice.decode`) and encoding into codec codes are the
pipeline's job, on its encode thread (cached there by `Voice.key`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import stat
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from higgs_stream.engine.codec import load_reference_audio, probe_reference_audio
from higgs_stream.engine.errors import AudioInputError, ConfigError, InvalidInputError, NotFoundError
from higgs_stream.stream.config import OPENAI_VOICES, ServerConfig
from higgs_stream.stream.errors import TooLargeError, brief

AUDIO_SUFFIXES = (".wav", ".flac", ".ogg")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT = "default"

@dataclass(frozen=True, eq=False)
class Voice:
    """A resolved voice. `audio is None` means the model's own voice (no reference)."""

    name: str
    audio: bytes | None = None  # the reference file (WAV/FLAC/OGG) as sent, header checked
    speaker: str | None = None  # one of the model's built-in speakers (no audio)
    transcript: str | None = None
    key: str = ""  # identifies the audio + transcript (cache key for encoded codes); "" = none
    duration_s: float = 0.0  # as the file's header announces it
    max_seconds: float = 30.0

    @property
    def has_reference(self) -> bool:
        return self.audio is not None

    def decode(self) -> tuple[np.ndarray, int]:
        """(mono float32 [T] at 24 kHz, 24000); AudioInputError when the audio is bad (undecodable,
        silent, too short or long). CPU work proportional to the file: not on the event loop."""
        assert self.audio is not None, f"voice {self.name!r} has no reference audio"
        return load_reference_audio(self.audio, max_seconds=self.max_seconds)


def _read_file(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; ConfigError otherwise. A preset read whole before any
    check hung start-up on a FIFO and filled memory from /dev/zero or a sparse 6 GB file; a folder, a symlink loop
    or a dangling one were tracebacks (a probe)."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"voice preset file {path} is not a regular file")
        if st.st_size > limit:
            raise ConfigError(f"voice preset file {path} has {st.st_size} bytes, limit {limit}")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"voice preset file {path}: {e.strerror or e}") from e
    if len(data) > limit:  # it grew after the stat
        raise ConfigError(f"voice preset file {path} has more than {limit} bytes")
    return data


def _key(name: str) -> str:
    """The form voice names are compared in: case-insensitive ("Nova", "NOVA" and "nova" are one name), by Unicode's
    case folding after NFKC ("STRASSE" is "straße", the Kelvin sign a K; "İzmir" stays apart from "Izmir", as Unicode
    has it). `str.lower()` before: "STRASSE" was not found (a probe)."""
    return unicodedata.normalize("NFKC", name).casefold()


def _content_key(audio: bytes, transcript: str) -> str:
    h = hashlib.sha256(audio)
    h.update(b"\0" + transcript.encode("utf-8"))
    return h.hexdigest()[:24]


class VoiceLibrary:
    def __init__(self, voices_dir: str | Path | None = None, aliases: dict[str, str] | None = None,
                 *, max_reference_bytes: int = 6 << 20, max_reference_s: float = 30.0,
                 max_transcript_chars: int = 2000, speakers: tuple[str, ...] = ()):
        self.max_reference_bytes = max_reference_bytes
        self.max_reference_s = max_reference_s
        self.max_transcript_chars = max_transcript_chars
        self.presets: dict[str, Voice] = {}
        self.voices_dir = None if voices_dir is None else Path(voices_dir)
        if self.voices_dir is not None:
            self.presets = self._load_presets(self.voices_dir)
        self._names: dict[str, str] = {_key(name): name for name in self.presets}  # _key(name) -> its spelling
        self._names.setdefault(DEFAULT, DEFAULT)  # a preset named `default` (in any case) is the default voice
        self.default = self.presets.get(self._names[DEFAULT], Voice(name=DEFAULT))
        self.speakers = {s.lower(): Voice(name=s.lower(), speaker=s.lower()) for s in speakers
                         if _key(s) not in self._names}  # the model's built-in voices
        self._names.update({_key(s): s for s in self.speakers})
        self.aliases: dict[str, str] = {name: DEFAULT for name in OPENAI_VOICES if _key(name) not in self._names}
        self._add_aliases(aliases or {})
        self._names.update({_key(a): a for a in self.aliases})

    def _add_aliases(self, aliases: dict[str, str]) -> None:
        """Configured aliases over the OpenAI ones (one of those given again, in any case, is replaced); ConfigError
        for a target that names no preset, speaker or `default`, or an alias that shadows one of them or another
        alias (in any case)."""
        given: dict[str, str] = {}  # _key(alias) -> alias, of the configured ones
        for alias, target in aliases.items():
            canonical = self._names.get(_key(target))
            if canonical is None:
                raise ConfigError(f"voice alias {alias!r} -> {target!r}: no preset or speaker named {target!r}")
            taken = self._names.get(_key(alias))
            if taken is not None:
                case = "" if taken == alias else f" ({taken!r}: voice names are case-insensitive)"
                raise ConfigError(f"voice alias {alias!r} shadows a preset or speaker of the same name{case}")
            if _key(alias) in given:
                raise ConfigError(f"voice aliases {given[_key(alias)]!r} and {alias!r} differ only by case (voice "
                                  f"names are case-insensitive)")
            given[_key(alias)] = alias
            for openai in [a for a in self.aliases if _key(a) == _key(alias)]:
                del self.aliases[openai]
            self.aliases[alias] = canonical

    @classmethod
    def from_config(cls, cfg: ServerConfig, speakers: tuple[str, ...] = ()) -> VoiceLibrary:
        """The server's voices; `speakers`: the model's built-in ones (`engine.policy.speakers`)."""
        return cls(cfg.voices_dir, cfg.voice_aliases, max_reference_bytes=cfg.max_reference_bytes,
                   max_reference_s=cfg.max_reference_s, max_transcript_chars=cfg.max_transcript_chars,
                   speakers=speakers)

    def _load_presets(self, folder: Path) -> dict[str, Voice]:
        if not folder.is_dir():
            raise ConfigError(f"voices folder {folder} " + ("is not a folder" if folder.exists() else "does not exist"))
        presets: dict[str, Voice] = {}
        for path in sorted(folder.iterdir()):
            if path.suffix.lower() not in AUDIO_SUFFIXES:
                continue
            name = path.stem
            if not _NAME.fullmatch(name):
                raise ConfigError(f"voice preset {path}: name must match [A-Za-z0-9_-]{{1,64}}")
            if name in presets:
                raise ConfigError(f"voice preset {name!r} has more than one audio file in {folder}")
            twin = next((other for other in presets if _key(other) == _key(name)), None)
            if twin is not None:
                raise ConfigError(f"voice presets {twin!r} and {name!r} in {folder} differ only by case (voice names "
                                  f"are case-insensitive): rename one")
            txt = path.with_suffix(".txt")
            if not txt.is_file():
                raise ConfigError(f"voice preset {path} has no transcript file {txt.name}")
            try:  # UTF-8: at most 4 bytes a character, and a BOM
                transcript = _read_file(txt, 4 * self.max_transcript_chars + 3).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"voice preset {name!r}: transcript {txt} is not UTF-8 text ({e.reason})") from e
            transcript = transcript.removeprefix("\ufeff").strip()  # a UTF-8 BOM is no part of it
            if not transcript:
                raise ConfigError(f"voice preset {name!r}: transcript {txt} is empty")
            if len(transcript) > self.max_transcript_chars:
                raise ConfigError(f"voice preset {name!r}: transcript {txt} has {len(transcript)} chars, limit "
                                  f"{self.max_transcript_chars}")
            data = _read_file(path, self.max_reference_bytes)
            try:
                presets[name] = self._checked(name, data, transcript)
                presets[name].decode()  # a bad preset fails at startup, not on first use
            except (AudioInputError, InvalidInputError) as e:
                raise ConfigError(f"voice preset {path}: {e}") from e
        return presets

    def check_transcripts(self, check: Callable[[str], None]) -> None:
        """Run `check` (the engine's `check_transcript`: InvalidInputError for a control token the prompt refuses)
        on every preset's transcript; ConfigError naming the preset's transcript file for the first it refuses.
        The model is known only once it has loaded, so the server calls this then (stream/serve_command.py)."""
        for name, voice in self.presets.items():
            try:
                check(voice.transcript)
            except InvalidInputError as e:
                raise ConfigError(f"voice preset {self.voices_dir / name}.txt: {e}") from e

    def names(self) -> list[str]:
        """Every name `resolve` takes, each in its own spelling (a preset's as its file names it)."""
        return sorted(self._names.values())

    def resolve(self, name: str) -> Voice:
        """A preset, a speaker, `default`, or an alias, named in any case; unknown names raise NotFoundError."""
        if not isinstance(name, str):
            raise InvalidInputError(f"voice must be a string, got {type(name).__name__}")
        canonical = self._names.get(_key(name))
        if canonical is None:
            raise NotFoundError(f"unknown voice {brief(name)}; known: {', '.join(self.names())}")
        if canonical in self.presets:
            return self.presets[canonical]
        if canonical in self.speakers:
            return self.speakers[canonical]
        if canonical in self.aliases:
            return self.resolve(self.aliases[canonical])
        return self.default

    def inline(self, audio_b64: str, transcript: str) -> Voice:
        """A reference sent with the request: base64 audio file (a data: URL is fine) + transcript.
        Only the file's header is read here; the audio is decoded later, by `Voice.decode`."""
        if not isinstance(audio_b64, str) or not audio_b64:
            raise InvalidInputError("reference audio must be a non-empty base64 string")
        if not isinstance(transcript, str) or not transcript.strip():
            raise InvalidInputError("a reference needs a non-empty transcript")
        if len(transcript) > self.max_transcript_chars:
            raise TooLargeError(f"reference transcript has {len(transcript)} chars, limit {self.max_transcript_chars}")
        if audio_b64.startswith("data:"):
            audio_b64 = audio_b64.partition(",")[2]
        if len(audio_b64) * 3 // 4 > self.max_reference_bytes + 3:
            raise TooLargeError(f"reference audio over {self.max_reference_bytes} bytes")
        try:
            data = base64.b64decode(audio_b64, validate=True)
        except (binascii.Error, ValueError) as e:
            raise AudioInputError(f"reference audio is not valid base64: {e}") from e
        if len(data) > self.max_reference_bytes:
            raise TooLargeError(f"reference audio has {len(data)} bytes, limit {self.max_reference_bytes}")
        key = _content_key(data, transcript.strip())
        return self._checked(f"inline:{key[:12]}", data, transcript.strip(), key)

    def _checked(self, name: str, data: bytes, transcript: str, key: str | None = None) -> Voice:
        if not data:
            raise AudioInputError("reference audio is empty")
        seconds = probe_reference_audio(data, max_seconds=self.max_reference_s)  # the header only
        return Voice(name=name, audio=data, transcript=transcript, key=key or _content_key(data, transcript),
                     duration_s=seconds, max_seconds=self.max_reference_s)

    def describe(self) -> dict:
        """The body of GET /v1/voices."""
        return {
            "default": DEFAULT,
            "voices": [{"name": v.name, "transcript": v.transcript, "seconds": round(v.duration_s, 2)}
                       for v in self.presets.values()],
            "speakers": list(self.speakers),
            "aliases": dict(sorted(self.aliases.items())),
        }
