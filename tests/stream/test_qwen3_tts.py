"""Qwen3-TTS through the pipeline and the server, on loopback (tiny random checkpoints written by
make-checkpoint --arch qwen3-tts, CPU): streamed PCM equals the one-shot decode of the offline
synthesis (s16 within 1 LSB, higgs_stream/testing.py) over WebSocket and HTTP; CustomVoice speakers
in /v1/voices and as the OpenAI `voice`; VoiceDesign instructions through the WebSocket `config` and
the HTTP body; Base voice cloning from reference audio (WebSocket `reference`, HTTP `reference_audio`,
a voices-folder preset) equal to the offline synthesis with the codes and x-vector the checkpoint's
encoders make; typed errors for an unknown speaker, instructions too long or not taken, and a Base
request without reference audio or transcript."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass, field

import aiohttp
import pytest
from higgs_stream.engine.codec import load_reference_audio
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.models.qwen3_tts.make_checkpoint import make_checkpoint_qwen
from higgs_stream.engine.models.registry import load_codec_for
from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
from higgs_stream.engine.synth import synthesize
from higgs_stream.stream.adapter import to_s16le
from higgs_stream.testing import assert_pcm_close
from higgs_stream.testing_server import TRANSPORTS, ServerStarter, pages_freed
from websockets.asyncio.client import connect

MAX_FRAMES = 40
HOP_BYTES = 1920 * 2  # one 80 ms frame of s16 PCM
INSTRUCTIONS = "A calm, low voice."


class Served:
    """A checkpoint's engine and codec for a server, and its offline synthesis on an engine of its own."""

    def __init__(self, ckpt) -> None:
        self.codec = load_codec_for(ckpt)
        self.engine = Engine.from_pretrained(str(ckpt), config=EngineConfig(kv_pages=512))
        self._offline = Engine.from_pretrained(str(ckpt), config=EngineConfig(kv_pages=128))

    def pcm(self, text: str, seed: int, **fields) -> bytes:
        req = GenerationRequest(text, sampling=SamplingParams(seed=seed), max_frames=MAX_FRAMES, **fields)
        return to_s16le(synthesize(self._offline, self.codec, req)[0])

    def reference(self, audio: bytes, transcript: str) -> Reference:
        """What the server makes of a reference file: codes and (Base) the x-vector, from the 24 kHz decode."""
        wav, sr = load_reference_audio(audio)
        return Reference(self.codec.encode(wav, sr), transcript, embedding=self.codec.speaker_embedding(wav, sr))

    def starter(self, transport: str = "aiohttp") -> ServerStarter:
        return ServerStarter(transport, self.engine, self.codec, MAX_FRAMES)


@pytest.fixture(scope="module")
def custom(tiny_qwen_ckpt) -> Served:
    return Served(tiny_qwen_ckpt)


@pytest.fixture(scope="module")
def design(tmp_path_factory) -> Served:
    return Served(make_checkpoint_qwen(tmp_path_factory.mktemp("qwen") / "design", "tiny", 1, variant="voice_design"))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Served:
    return Served(make_checkpoint_qwen(tmp_path_factory.mktemp("qwen") / "base", "tiny", 2, variant="base"))


@pytest.fixture
async def servers():
    started: list[ServerStarter] = []

    async def start(served: Served, transport: str = "aiohttp", **cfg):
        started.append(served.starter(transport))
        return await started[-1](**cfg)

    yield start
    for s in started:
        await s.close()
        assert s.engine.num_active == 0 and s.engine.cache.allocator.num_used == 0, "KV pages leaked"


async def post(host: str, body: dict) -> tuple[int, bytes | dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"http://{host}/v1/audio/speech", json={"response_format": "pcm", **body}) as r:
            return r.status, (await r.read() if r.status == 200 else await r.json())


@dataclass
class Heard:
    """One connection's messages: PCM per context (binary frames inside audio_start/done), errors, dones."""

    pcm: dict[str, bytearray] = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)
    done: dict[str, dict] = field(default_factory=dict)


async def ws_context(host: str, messages: list[dict], cid: str = "a") -> Heard:
    """Send `messages` on a new connection; read until context `cid` is done."""
    heard, playing = Heard(), None
    async with connect(f"ws://{host}/v1/tts/stream", compression=None) as ws:
        for m in messages:
            await ws.send(json.dumps(m))
        async with asyncio.timeout(60):
            while cid not in heard.done:
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    heard.pcm[playing] += msg
                    continue
                ev = json.loads(msg)
                if ev["type"] == "audio_start":
                    playing = ev["context_id"]
                    heard.pcm[playing] = bytearray()
                elif ev["type"] == "done":
                    heard.done[ev["context_id"]] = ev
                elif ev["type"] == "error":
                    heard.errors.append(ev)
    return heard



@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_streamed_pcm_equals_the_one_shot_decode(custom, servers, transport):
    host, _ = await servers(custom, transport)
    want = custom.pcm("Hello there.", 5, speaker="dylan")
    assert len(want) >= 20 * HOP_BYTES  # several chunks of the schedule (1, 2, 4, 8, ... frames)
    heard = await ws_context(host, [{"type": "text", "context_id": "a", "text": "Hello there.", "seed": 5,
                                   "voice": "dylan"}, {"type": "end", "context_id": "a"}])
    assert heard.done["a"]["reason"] == "completed" and heard.errors == []
    assert_pcm_close(bytes(heard.pcm["a"]), want, what="ws vs one-shot")
    status, got = await post(host, {"model": "tts-1", "input": "Hello there.", "voice": "Dylan", "seed": 5})
    assert status == 200
    assert_pcm_close(got, want, what="http vs one-shot")
    async with aiohttp.ClientSession() as http:  # SSE usage counts 80 ms codec frames
        async with http.post(f"http://{host}/v1/audio/speech", json={"input": "Hello there.", "voice": "dylan",
                                                                      "seed": 5, "stream_format": "sse"}) as r:
            events = [json.loads(b[6:]) for b in (await r.text()).split("\n\n") if b]
    assert events[-1]["usage"]["output_tokens"] == len(want) // HOP_BYTES
    await pages_freed(custom.engine)


async def test_speakers_are_voices(custom, servers):
    host, _ = await servers(custom)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{host}/v1/voices") as r:
            listing = await r.json()
    assert listing["speakers"] == ["aiden", "dylan"] and listing["aliases"]["alloy"] == "default"
    aiden = custom.pcm("Hello there.", 5, speaker="aiden")
    assert aiden != custom.pcm("Hello there.", 5, speaker="dylan")
    for voice in ("aiden", "AIDEN", "alloy", "default"):  # default: the checkpoint's first speaker
        status, got = await post(host, {"input": "Hello there.", "voice": voice, "seed": 5})
        assert status == 200, got
        assert_pcm_close(got, aiden, what=voice)
    status, err = await post(host, {"input": "Hello there.", "voice": "vivian"})
    assert status == 400 and err["error"]["code"] == "not_found" and "aiden" in err["error"]["message"]
    heard = await ws_context(host, [{"type": "text", "context_id": "x", "text": "Hi.", "voice": "vivian"},
                                  {"type": "text", "context_id": "a", "text": "Hi.", "voice": "aiden"},
                                  {"type": "end", "context_id": "a"}])
    assert [e["code"] for e in heard.errors] == ["not_found"] and "x" not in heard.done


async def test_a_context_s_segments_keep_the_speaker(custom, servers):
    """Qwen3-TTS takes no history: each segment is its own request with the context's speaker."""
    host, _ = await servers(custom)
    heard = await ws_context(host, [{"type": "config", "voice": "dylan"},
                                  {"type": "text", "context_id": "a", "text": "Hello there. How are you?", "seed": 9},
                                  {"type": "end", "context_id": "a"}])
    want = custom.pcm("Hello there.", 9, speaker="dylan") + custom.pcm("How are you?", 10, speaker="dylan")
    assert_pcm_close(bytes(heard.pcm["a"]), want, what="two segments")


async def test_voice_design_instructions(design, servers):
    host, _ = await servers(design)
    want = design.pcm("Hello there.", 4, instructions=INSTRUCTIONS)
    assert want != design.pcm("Hello there.", 4) and len(want) >= 2 * HOP_BYTES
    heard = await ws_context(host, [{"type": "config", "instructions": INSTRUCTIONS},
                                  {"type": "text", "context_id": "a", "text": "Hello there.", "seed": 4},
                                  {"type": "end", "context_id": "a"}])
    assert_pcm_close(bytes(heard.pcm["a"]), want, what="ws config instructions")
    status, got = await post(host, {"input": "Hello there.", "instructions": INSTRUCTIONS, "seed": 4})
    assert status == 200
    assert_pcm_close(got, want, what="http instructions")
    status, err = await post(host, {"input": "Hi.", "instructions": "x" * 1001})
    assert status == 413 and err["error"]["code"] == "too_large" and "instructions" in err["error"]["message"]
    heard = await ws_context(host, [{"type": "config", "instructions": "x" * 1001},
                                  {"type": "text", "context_id": "a", "text": "Hi.", "instructions": "x" * 1001},
                                  {"type": "text", "context_id": "a", "text": "Hi."}, {"type": "end", "context_id": "a"}])
    assert [e["code"] for e in heard.errors] == ["too_large", "too_large"] and heard.done["a"]["reason"] == "completed"
    status, err = await post(host, {"input": "Hi.", "voice": "aiden"})  # VoiceDesign has no speakers
    assert status == 400 and err["error"]["code"] == "not_found"


async def test_what_a_variant_does_not_take_is_a_typed_error(custom, base, servers, wav_bytes):
    host, _ = await servers(custom)
    status, err = await post(host, {"input": "Hi.", "instructions": INSTRUCTIONS})  # a 0.6B CustomVoice
    assert status == 400 and err["error"]["code"] == "invalid_input" and "takes no instructions" in err["error"]["message"]
    status, err = await post(host, {"input": "Hi.", "reference_audio": base64.b64encode(wav_bytes()).decode(),
                                    "reference_text": "Hello."})
    assert status == 400 and err["error"]["code"] == "invalid_input" and "takes no reference audio" in err["error"]["message"]
    host, _ = await servers(base)
    status, err = await post(host, {"input": "Hi."})
    assert status == 400 and err["error"]["code"] == "invalid_input" and "clones a voice" in err["error"]["message"]
    heard = await ws_context(host, [{"type": "text", "context_id": "a", "text": "Hi."}, {"type": "end", "context_id": "a"}])
    assert [e["code"] for e in heard.errors] == ["invalid_input"] and heard.done["a"]["reason"] == "error"
    b64 = base64.b64encode(wav_bytes()).decode()
    heard = await ws_context(host, [{"type": "text", "context_id": "a", "text": "Hi.", "reference":  # refused
                                     {"audio": b64, "transcript": ""}},
                                    {"type": "text", "context_id": "a", "text": "Hi."}, {"type": "end", "context_id": "a"}])
    assert [e["code"] for e in heard.errors] == ["invalid_input"] * 2 and heard.done["a"]["reason"] == "error"
    assert "transcript" in heard.errors[0]["message"]
    status, err = await post(host, {"input": "Hi.", "reference_audio": b64})
    assert status == 400 and err["error"]["code"] == "invalid_input" and "reference_text" in err["error"]["message"]
    status, err = await post(host, {"input": "Hi.", "reference_audio": base64.b64encode(wav_bytes(0.01)).decode(),
                                    "reference_text": "Hello."})
    assert status == 400 and err["error"]["code"] == "bad_audio" and "too short" in err["error"]["message"]


async def test_base_clones_a_voice_from_reference_audio(base, servers, wav_bytes, tmp_path):
    """The reference audio (16 kHz here: resampled to 24 kHz) becomes codes and an x-vector on the
    server's encode thread; the streamed PCM equals the offline synthesis with that reference."""
    audio, transcript = wav_bytes(0.6, 16000, 180.0), "Hello, this is me."
    ref = base.reference(audio, transcript)
    assert ref.codes.shape == (16, 8) and ref.embedding.shape == (16,)
    want = base.pcm("Hi there.", 3, reference=ref)
    assert len(want) >= 2 * HOP_BYTES
    voices = tmp_path / "voices"  # a preset of the voices folder clones the same way
    voices.mkdir()
    (voices / "me.wav").write_bytes(audio)
    (voices / "me.txt").write_text(transcript)
    host, _ = await servers(base, voices_dir=str(voices))  # one server: one engine is stepped by one pipeline
    b64 = base64.b64encode(audio).decode()
    heard = await ws_context(host, [{"type": "config", "reference": {"audio": b64, "transcript": transcript}},
                                    {"type": "text", "context_id": "a", "text": "Hi there.", "seed": 3},
                                    {"type": "end", "context_id": "a"}])
    assert heard.errors == [] and heard.done["a"]["reason"] == "completed"
    assert_pcm_close(bytes(heard.pcm["a"]), want, what="ws reference")
    status, got = await post(host, {"input": "Hi there.", "reference_audio": b64, "reference_text": transcript,
                                    "seed": 3})
    assert status == 200, got
    assert_pcm_close(got, want, what="http reference")
    status, got = await post(host, {"input": "Hi there.", "voice": "me", "seed": 3})
    assert status == 200, got
    assert_pcm_close(got, want, what="preset voice")
    await pages_freed(base.engine)


def test_serve_builds_the_speakers_into_its_voices(tiny_qwen_ckpt):
    import argparse

    from higgs_stream.stream import serve_command

    def args(*argv):
        parser = argparse.ArgumentParser()
        serve_command.add_arguments(parser)
        return parser.parse_args(["--device", "cpu", *argv])

    state = serve_command.build_state(args("--model", str(tiny_qwen_ckpt), "--max-streams", "2"))
    assert state.voices.describe()["speakers"] == ["aiden", "dylan"] and state.pipeline.geometry.hop == 1920
    assert type(state.pipeline.engine.runner).__name__ == "RefRunner"
    from higgs_stream.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="Higgs codec"):  # the Higgs decoder's option, named as such
        serve_command.build_state(args("--model", str(tiny_qwen_ckpt), "--codec-gemm-max-rate-out", "40"))
