"""HiggsStreamTTSService in a real Pipecat pipeline (pipecat.tests.utils.run_test) against a live
server on the tiny random checkpoint."""

from __future__ import annotations


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
from higgs_stream.testing import assert_pcm_close

TEXT = "The quick brown fox jumps over the lazy dog."
SEED = 4


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
    assert_pcm_close(streamed, expected)


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


async def test_interruption_cancels_the_context_and_the_next_one_plays(live_server):
    tts = HiggsStreamTTSService(url=live_server.ws, seed=SEED)
    long_text = " ".join([TEXT] * 6)  # six segments, up to 36 s of audio: still generating at 0.5 s
    down, _ = await run_test(tts, frames_to_send=[
        TTSSpeakFrame(long_text),
        SleepFrame(sleep=0.5),
        InterruptionFrame(),
        SleepFrame(sleep=0.3),
        TTSSpeakFrame("Hello there."),
    ], ignore_start=True)
    started = [f.context_id for f in _frames(down, TTSStartedFrame)]
    assert len(started) == 2 and started[0] != started[1], started
    first, second = started
    cut = next(i for i, f in enumerate(down) if isinstance(f, InterruptionFrame))
    first_audio = [i for i, f in enumerate(down) if isinstance(f, TTSAudioRawFrame) and f.context_id == first]
    second_audio = [i for i, f in enumerate(down) if isinstance(f, TTSAudioRawFrame) and f.context_id == second]
    assert first_audio and max(first_audio) < cut  # it had started; nothing of it leaked afterwards
    assert second_audio and min(second_audio) > cut
    assert [f.context_id for f in _frames(down, TTSStoppedFrame)] == [second]
    # The server stopped generating the first context (cancelled, not completed).
    metrics = live_server.state.metrics
    assert metrics.requests.value(transport="ws", outcome="cancelled") == 1
    assert metrics.requests.value(transport="ws", outcome="completed") == 1


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
