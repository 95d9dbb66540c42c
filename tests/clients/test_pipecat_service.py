"""HiggsStreamTTSService in a real Pipecat pipeline (pipecat.tests.utils.run_test) against a live
server on the tiny random checkpoint."""

from __future__ import annotations

import asyncio

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
from higgs_stream.testing_server import wait_until

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


async def test_a_refused_context_is_one_error_and_one_stop(live_server):
    """An unknown voice: the server refuses the context's first text (not_found). The pipeline sees that one error
    and the context's TTSStoppedFrame; the server's not_found answers to the `end` and `cancel` sent for the
    context before and after the refusal are not errors of its own (two more ErrorFrames before, found by a probe)."""
    tts = HiggsStreamTTSService(url=live_server.ws, voice="no-such-voice")
    down, up = await run_test(tts, frames_to_send=[TTSSpeakFrame(TEXT), SleepFrame(sleep=0.5)])
    errors = [f.error for f in _frames(up, ErrorFrame) if "server error" in f.error]  # (and Pipecat's own "no audio")
    assert len(errors) == 1 and "no-such-voice" in errors[0], errors
    assert len(_frames(down, TTSStoppedFrame)) == 1 and not _frames(down, TTSAudioRawFrame)


async def test_a_dropped_connection_reports_its_open_context(server_factory):
    """The server goes away mid-utterance: the pipeline gets an error naming the context that ended with the
    connection (it got nothing: its contexts were forgotten, found by a probe). The TTSStoppedFrame the service
    appends for it does not come downstream in Pipecat 1.14 (its reconnect handling; not investigated further)."""
    server = await server_factory()
    tts = HiggsStreamTTSService(url=server.ws, seed=SEED)

    async def drop_when_audio_flows():
        await wait_until(lambda: server.state.metrics.audio_seconds.value() > 0, 30)
        for ws in list(server.state.sockets):
            await ws.close(1011, "test: server gone")

    dropper = asyncio.ensure_future(drop_when_audio_flows())
    try:
        down, up = await run_test(tts, frames_to_send=[TTSSpeakFrame(" ".join([TEXT] * 6)), SleepFrame(sleep=2.0)])
    finally:
        dropper.cancel()
    (started,) = _frames(down, TTSStartedFrame)
    errors = [f.error for f in _frames(up, ErrorFrame)]
    assert any(f"context {started.context_id} ended: the connection closed" in e for e in errors), errors
