"""Pipecat's stock `OpenAITTSService` and the `openai` SDK against a live server (tiny random
checkpoint, loopback): the settings README "Pipecat" documents, one test each.

What the stock service (pipecat-ai 1.14, `pipecat/services/openai/tts.py`) sends is
`{input, model, voice, response_format: "pcm"}` (+ `instructions`, `speed` when set): no sample
rate, no extra body. It labels the PCM it gets with its own `sample_rate`, or, when that is None,
with the pipeline's `audio_out_sample_rate`, and only logs a warning when that is not 24000. So
the server cannot know the pipeline's rate; the service must say 24000 and the output transport
resamples. A pipecat output transport (`Speaker`, a real `BaseOutputTransport` that keeps what it
would play) shows what a listener hears.

The stock service cannot send a seed, so these tests pin the one the server samples with
(`pin_seed`) to compare the audio with the offline synthesis.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import openai
import pytest
import soxr
from pipecat.frames.frames import ErrorFrame, StartFrame, TTSAudioRawFrame, TTSSpeakFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams
from pipecat.processors.frame_processor import FrameProcessor
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.tests.utils import run_test
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams

from higgs_stream.stream.encoders import Resampler
from higgs_stream.testing import assert_pcm_close

TEXT = "The quick brown fox jumps over the lazy dog."
SEED = 4
CHUNK_MS = 40  # the transport writes 4 x 10 ms chunks; the last one is padded with silence


class Tap(FrameProcessor):
    """Keeps the audio frames the TTS service pushes (what it labelled them) and passes all on."""

    def __init__(self):
        super().__init__()
        self.frames: list[TTSAudioRawFrame] = []

    async def process_frame(self, frame, direction):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.frames.append(frame)
        await self.push_frame(frame, direction)


class Speaker(BaseOutputTransport):
    """A pipecat output transport that keeps what it would play instead of playing it."""

    def __init__(self):
        super().__init__(TransportParams(audio_out_enabled=True, audio_out_end_silence_secs=0))
        self.written: list = []

    async def start(self, frame: StartFrame):
        await super().start(frame)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame) -> bool:
        self.written.append(frame)
        return True

    def played(self) -> tuple[bytes, int]:
        rates = {f.sample_rate for f in self.written}
        assert len(rates) == 1, rates
        return b"".join(f.audio for f in self.written), rates.pop()


def pin_seed(state, seed: int) -> None:
    """Every stream the server opens samples with `seed` (the stock service sends none)."""
    open_ = state.pipeline.open
    state.pipeline.open = lambda options, **kw: open_(dataclasses.replace(options, seed=seed), **kw)


async def speak(live, pipeline_rate: int, **service_args) -> tuple[Tap, Speaker]:
    tts = OpenAITTSService(base_url=f"{live.http}/v1", api_key="unused", **service_args)
    tap, speaker = Tap(), Speaker()
    _, up = await run_test(Pipeline([tts, tap, speaker]), frames_to_send=[TTSSpeakFrame(TEXT)],
                           pipeline_params=PipelineParams(audio_out_sample_rate=pipeline_rate))
    errors = [f.error for f in up if isinstance(f, ErrorFrame)]
    assert not errors, errors
    assert tap.frames, "no audio reached the pipeline"
    return tap, speaker


def service_audio(tap: Tap) -> tuple[bytes, int]:
    rates = {f.sample_rate for f in tap.frames}
    assert len(rates) == 1, rates
    return b"".join(f.audio for f in tap.frames), rates.pop()


async def synthesized(live, reference_pcm) -> bytes:
    await live.state.pipeline.stop()  # the engine thread is idle; stop it before generate()
    return reference_pcm(live.state, TEXT, SEED)


async def test_stock_service_in_a_24khz_pipeline_plays_the_synthesized_audio(live_server, reference_pcm):
    """Setting 1: the pipeline at 24 kHz (PipelineParams' default): nothing to set."""
    pin_seed(live_server.state, SEED)
    tap, speaker = await speak(live_server, 24000)
    got, label = service_audio(tap)
    played, rate = speaker.played()
    expected = await synthesized(live_server, reference_pcm)
    assert label == rate == 24000
    assert_pcm_close(got, expected, what="service frames")
    # The transport plays it unchanged, then pads its last 40 ms chunk with silence.
    pad = len(played) - len(expected)
    assert 0 <= pad < 2 * 24 * CHUNK_MS and played[:len(expected)] == got and not any(played[len(expected):])


async def test_stock_service_in_a_16khz_pipeline_needs_sample_rate_24000(live_server, reference_pcm):
    """Setting 2: any other pipeline rate: `OpenAITTSService(sample_rate=24000)`. The frames say
    24 kHz and the output transport resamples them (soxr VHQ, streaming) to its 16 kHz: the
    listener hears the synthesized duration (within one sample, plus one padded 40 ms chunk; measured
    equal), and the samples equal soxr's one-shot resample of the offline synthesis within 4 LSB
    (measured 2) up to its last 10 ms."""
    pin_seed(live_server.state, SEED)
    tap, speaker = await speak(live_server, 16000, sample_rate=24000)
    got, label = service_audio(tap)
    played, rate = speaker.played()
    expected = await synthesized(live_server, reference_pcm)
    assert (label, rate) == (24000, 16000)
    assert_pcm_close(got, expected, what="service frames")
    seconds, heard = len(expected) / 2 / 24000, len(played) / 2 / 16000
    print(f"synthesized {seconds:.3f} s, heard {heard:.3f} s at 16 kHz")
    assert -1 / 16000 <= heard - seconds < CHUNK_MS / 1000, (heard, seconds)  # a sample of rounding, a chunk of padding
    want = soxr.resample(np.frombuffer(expected, "<i2"), 24000, 16000, quality="VHQ")
    n = len(want) - 160  # the stream resampler's last 10 ms come from its flush
    lsb = assert_pcm_close(played[:2 * n], want[:n].tobytes(), max_lsb=4, what="played vs soxr one-shot")
    print(f"played vs soxr one-shot resample: max {lsb} LSB")


async def test_stock_service_in_a_16khz_pipeline_without_the_setting_is_slow_and_low(live_server, reference_pcm):
    """What happens without setting 2 (why the README asks for it): the 24 kHz PCM is labelled
    16 kHz, plays 1.5x as long, a fifth lower; Pipecat only logs a warning. Nothing the server
    could detect: the request is the same as in a 24 kHz pipeline."""
    pin_seed(live_server.state, SEED)
    tap, speaker = await speak(live_server, 16000)
    got, label = service_audio(tap)
    played, rate = speaker.played()
    expected = await synthesized(live_server, reference_pcm)
    assert (label, rate) == (16000, 16000)
    assert_pcm_close(got, expected, what="the same 24 kHz samples")
    heard, seconds = len(played) / 2 / 16000, len(expected) / 2 / 24000
    assert abs(heard / seconds - 1.5) < 0.05, (heard, seconds)


async def test_openai_sdk_asks_for_another_rate_with_extra_body(live_server, reference_pcm):
    """Our extension for clients that can add body fields (the `openai` SDK's `extra_body`, a
    Pipecat subclass): `sample_rate` makes the server resample as it streams. The PCM equals a
    one-shot resample of the offline synthesis within 3 LSB."""
    client = openai.AsyncOpenAI(base_url=f"{live_server.http}/v1", api_key="unused")
    async with client.audio.speech.with_streaming_response.create(
            model="higgs", voice="alloy", input=TEXT, response_format="pcm",
            extra_body={"sample_rate": 16000, "seed": SEED}) as r:
        assert r.headers["content-type"] == "audio/pcm;rate=16000;channels=1"
        got = b"".join([chunk async for chunk in r.iter_bytes()])
    with pytest.raises(openai.BadRequestError) as refused:
        await client.audio.speech.create(model="higgs", voice="alloy", input=TEXT, response_format="pcm",
                                         extra_body={"sample_rate": 11025})
    assert refused.value.code == "invalid_input" and "use one of 8000, 16000, 22050" in refused.value.message
    await client.close()
    expected = await synthesized(live_server, reference_pcm)
    whole = Resampler(16000)
    want = whole.feed(expected) + whole.flush()
    assert_pcm_close(got, want, max_lsb=3, what="sdk pcm at 16 kHz")
