"""Parsing what a client sends (stream/messages.py): the HTTP speech body (PROTOCOL.md §2).

The WebSocket messages' schema is tested through the session that runs them (test_session.py).
"""

from __future__ import annotations

import base64
import json

import pytest
from higgs_stream.engine.errors import AudioInputError, HiggsStreamError, InvalidInputError
from higgs_stream.stream.config import ServerConfig
from higgs_stream.stream.errors import TooLargeError
from higgs_stream.stream.messages import SPEECH_KEYS, check_fields, parse_options, parse_speech
from higgs_stream.stream.voices import VoiceLibrary


def speech(voices, **body):
    return parse_speech(json.dumps(body).encode(), ServerConfig(), voices)


def test_parse_speech_openai_shape(voices, wav_bytes):
    r = speech(voices, model="tts-1", input="Hello.", voice="alloy", response_format="pcm", speed=1.0)
    assert (r.input, r.response_format, r.stream_format, r.options.voice.name) == ("Hello.", "pcm", "audio", "default")
    r = speech(voices, input="Hi", voice={"id": "belinda"}, stream_format="sse", instructions="calm", seed=5,
               temperature=0.3, top_k=50, top_p=0.9, mode="low_latency")
    o = r.options
    assert (o.voice.name, o.instructions, o.scene, o.seed, o.temperature, o.top_k, o.top_p, o.mode) == (
        "belinda", "calm", None, 5, 0.3, 50, 0.9, "low_latency")  # instructions: the model's (v2: its scene)
    r = speech(voices, input="Hi", reference_audio=base64.b64encode(wav_bytes()).decode(), reference_text="clip")
    assert r.options.voice.has_reference and r.options.voice.transcript == "clip"
    assert speech(voices, input="Hi", response_format="wav").response_format == "wav"
    # OpenAI's formats, mp3 when none is named (as OpenAI); sse carries any of them
    assert speech(voices, input="Hi").response_format == "mp3"
    for fmt in ("mp3", "opus", "aac", "flac", "wav", "pcm"):
        assert speech(voices, input="Hi", response_format=fmt, stream_format="sse").response_format == fmt


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 4.0, 0.1, 5, "fast", True])
def test_speed_other_than_one_is_a_typed_error_naming_it(voices, speed):
    with pytest.raises(HiggsStreamError) as e:
        speech(voices, input="Hi", speed=speed)
    assert e.value.code == "invalid_input" and "speed" in str(e.value)
    in_range = isinstance(speed, float) and 0.25 <= speed <= 4.0
    assert ("1.0 only" in str(e.value)) == in_range, str(e.value)


@pytest.mark.parametrize("body, code", [
    ({}, "invalid_input"),
    ({"input": "   "}, "invalid_input"),
    ({"input": "x" * 5000}, "too_large"),
    ({"input": "x", "response_format": "ogg"}, "invalid_input"),
    ({"input": "x", "speed": 1.5}, "invalid_input"),
    ({"input": "x", "voice": "nobody"}, "not_found"),
    ({"input": "x", "reference_audio": "AAAA"}, "invalid_input"),
    ({"input": "x", "reference_audio": base64.b64encode(b"junk" * 100).decode(), "reference_text": "t"}, "bad_audio"),
    ({"input": "x", "sample_rate": 11025}, "invalid_input"),
    ({"input": "x", "colour": "blue"}, "invalid_input"),
])
def test_parse_speech_errors(voices, body, code):
    with pytest.raises(HiggsStreamError) as e:
        speech(voices, **body)
    assert e.value.code == code


@pytest.mark.parametrize("field", ["response_format", "stream_format"])
@pytest.mark.parametrize("value", [False, 0, "", [], {}])
def test_falsy_formats_are_not_taken_for_the_default(voices, field, value):
    """false, 0, "" or [] for a format is invalid_input naming the field (`msg.get(...) or default` took them for
    mp3 / audio, found by a probe); only an absent field or null gets the default."""
    with pytest.raises(HiggsStreamError) as e:
        speech(voices, input="x", **{field: value})
    assert e.value.code == "invalid_input" and field in str(e.value)
    default = speech(voices, input="x", **{field: None})
    assert (default.response_format, default.stream_format) == ("mp3", "audio")


def test_unknown_fields_are_named_briefly():
    """At most 8 unknown fields named, each as `brief` shortens it (a 4 MB key came back as a 4 MB error)."""
    with pytest.raises(HiggsStreamError) as e:
        check_fields({"input": "x", "k" * 4_000_000: 1, **{f"f{i}": i for i in range(20)}}, SPEECH_KEYS, "speech request")
    message = str(e.value)
    assert e.value.code == "invalid_input" and len(message) < 1000, len(message)
    assert message.startswith("unknown field(s) in speech request: 'f0', 'f1', ") and message.endswith(" and 13 more")


def test_sample_rate_is_the_response_rate_from_a_fixed_list(voices):
    assert speech(voices, input="Hi").sample_rate == 24000
    for rate in (8000, 16000, 22050, 24000, 44100, 48000):
        assert speech(voices, input="Hi", response_format="pcm", sample_rate=rate).sample_rate == rate
    assert speech(voices, input="Hi", response_format="opus", sample_rate=48000).sample_rate == 48000
    assert speech(voices, input="Hi", sample_rate=None).sample_rate == 24000
    for fmt, rate in [("pcm", 11025), ("pcm", 16000.0), ("pcm", "16000"), ("pcm", True), ("pcm", [16000]),
                      ("opus", 22050), ("opus", 44100)]:
        with pytest.raises(HiggsStreamError) as e:
            speech(voices, input="Hi", response_format=fmt, sample_rate=rate)
        allowed = "8000, 16000, 24000, 48000" if fmt == "opus" else "8000, 16000, 22050, 24000, 44100, 48000"
        assert e.value.code == "invalid_input" and f"use one of {allowed}" in str(e.value), (fmt, rate, str(e.value))


def test_parse_speech_not_json(voices, wav_bytes):
    for body, code in [(b"input=hello", "bad_json"), (b"[" * 1000 + b"]" * 1000, "bad_json"),
                       (b'{"input": "\xff\xfe"}', "bad_json"), (b'{"input": "\\ud800 hi"}', "invalid_input")]:
        with pytest.raises(HiggsStreamError) as e:
            parse_speech(body, ServerConfig(), voices)
        assert e.value.code == code, body
    with pytest.raises(AudioInputError):
        VoiceLibrary().inline(base64.b64encode(wav_bytes(40.0)).decode(), "too long")


def test_bad_reference_audio_error_names_the_problem_not_an_address(voices):
    with pytest.raises(AudioInputError) as e:
        speech(voices, input="x", reference_audio=base64.b64encode(b"junk" * 100).decode(), reference_text="t")
    assert e.value.code == "bad_audio" and "0x" not in str(e.value) and "not a WAV, FLAC, OGG or MP3" in str(e.value)


def test_instructions_are_an_option_of_their_own(voices):
    cfg = ServerConfig()
    assert parse_options({"instructions": "A calm voice."}, cfg, voices).instructions == "A calm voice."
    assert parse_options({"instructions": ""}, cfg, voices).instructions == ""  # "": none
    with pytest.raises(TooLargeError, match="instructions have 1001 chars"):
        parse_options({"instructions": "x" * 1001}, cfg, voices)
    with pytest.raises(InvalidInputError, match="either instructions or scene"):
        parse_options({"instructions": "calm", "scene": "a hall"}, cfg, voices)
    with pytest.raises(InvalidInputError, match="instructions must be a string"):
        parse_options({"instructions": 3}, cfg, voices)
    with pytest.raises(InvalidInputError, match="either instructions or scene"):
        speech(voices, input="Hi", instructions="calm", scene="a hall")
