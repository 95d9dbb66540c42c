"""HiggsStreamTTSService in a real Pipecat pipeline (pipecat.tests.utils.run_test) against a live
server on the tiny random checkpoint."""

from __future__ import annotations

import pytest
import torch

from pipecat.frames.frames import (
    ErrorFrame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.worker import PipelineParams
from pipecat.tests.utils import SleepFrame, run_test

from higgs_stream.clients.pipecat_service import HiggsStreamTTSService

TEXT = "The quick brown fox jumps over the lazy dog."
SEED = 4


@pytest.fixture(autouse=True, scope="module")
def length_invariant_convs():
    """Byte-exact streaming needs conv arithmetic that does not depend on the input length: oneDNN
    picks CPU kernels by length (a window vs the one-shot decode then differ by an s16 LSB now and
    then); PyTorch's native CPU convs do not (as in tests/stream/test_pipeline.py)."""
    with torch.backends.mkldnn.flags(enabled=False):
        yield


def _frames(down, kind):
    return [f for f in down if isinstance(f, kind)]


async def test_seeded_speech_equals_offline_synthesis_byte_for_byte(live_server, reference_pcm):
    tts = HiggsStreamTTSService(url=live_server.ws, seed=SEED)
    down, up = await run_test(tts, frames_to_send=[TTSSpeakFrame(TEXT)])
    audio = _frames(down, TTSAudioRawFrame)
    assert audio, f"no audio reached the pipeline; frames: {[type(f).__name__ for f in down]}"
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    streamed = b"".join(f.audio for f in audio)
    # Bracketing: one started, the audio, one stopped; the spoken text comes out (no word times in v1).
    kinds = [type(f) for f in down if isinstance(f, (TTSStartedFrame, TTSAudioRawFrame, TTSStoppedFrame))]
    assert kinds[0] is TTSStartedFrame and kinds[-1] is TTSStoppedFrame and kinds.count(TTSStoppedFrame) == 1
    assert "".join(f.text for f in _frames(down, TTSTextFrame)).replace(" ", "") == TEXT.replace(" ", "")
    assert not _frames(up, ErrorFrame), [f.error for f in _frames(up, ErrorFrame)]

    await live_server.state.pipeline.stop()  # the engine thread is idle; stop it before generate()
    expected = reference_pcm(live_server.state, TEXT, SEED)
    assert len(streamed) == len(expected) > 24000, (len(streamed), len(expected))
    assert streamed == expected


async def test_resamples_to_the_pipeline_rate(live_server, reference_pcm):
    tts = HiggsStreamTTSService(url=live_server.ws, seed=SEED)
    down, _ = await run_test(tts, frames_to_send=[TTSSpeakFrame(TEXT)],
                             pipeline_params=PipelineParams(audio_out_sample_rate=16000))
    audio = _frames(down, TTSAudioRawFrame)
    assert audio and all(f.sample_rate == 16000 for f in audio)
    await live_server.state.pipeline.stop()
    expected_samples = len(reference_pcm(live_server.state, TEXT, SEED)) // 2
    got = sum(len(f.audio) // 2 for f in audio)
    assert got == expected_samples * 16000 // 24000, (got, expected_samples)  # the tail is flushed at done


async def test_interruption_cancels_the_context_and_the_next_one_plays(live_server, reference_pcm):
    tts = HiggsStreamTTSService(url=live_server.ws, seed=SEED)
    down, _ = await run_test(tts, frames_to_send=[
        TTSSpeakFrame(TEXT),
        SleepFrame(sleep=0.6),  # audio has started
        InterruptionFrame(),
        SleepFrame(sleep=0.3),
        TTSSpeakFrame("Hello there."),
    ])
    started = [f.context_id for f in _frames(down, TTSStartedFrame)]
    assert len(started) == 2 and started[0] != started[1], started
    first, second = started
    first_audio = sum(len(f.audio) for f in _frames(down, TTSAudioRawFrame) if f.context_id == first)
    second_audio = sum(len(f.audio) for f in _frames(down, TTSAudioRawFrame) if f.context_id == second)
    await live_server.state.pipeline.stop()
    full = len(reference_pcm(live_server.state, TEXT, SEED))
    assert first_audio < full, (first_audio, full)  # cut short, nothing leaked afterwards
    assert second_audio > 0
    assert [f.context_id for f in _frames(down, TTSStoppedFrame)][-1] == second
    metrics = live_server.state.metrics.render()
    assert 'outcome="cancelled"' in metrics, metrics


async def test_example_bot_speaks_an_llm_reply_on_one_context(live_server, tmp_path):
    from higgs_stream.clients.pipecat_bot_example import speak_reply

    reply = "Hi there! I am a bot. This reply streams sentence by sentence."
    out = tmp_path / "bot.wav"
    sink = await speak_reply(live_server.ws, reply, out, seed=SEED)
    assert len(sink.contexts) == 1 and sink.stopped == 1  # three sentences, one context
    handles = live_server.state.metrics.render()
    assert 'outcome="completed"' in handles
    import wave

    with wave.open(str(out), "rb") as w:
        assert w.getframerate() == 24000 and w.getnframes() == sink.samples > 24000
