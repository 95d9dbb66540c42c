"""Example Pipecat bot pipeline speaking through a higgs-stream server.

    python -m higgs_stream.clients.pipecat_bot_example --url ws://127.0.0.1:8000/v1/tts/stream \\
        -o bot.wav "Hi! I am a bot. This reply streams sentence by sentence."

The reply is fed the way an LLM produces it (a response start, text tokens, a response end), so
the service aggregates sentences and sends them on one context, as in a real voice agent. The
audio goes to a WAV sink here; in a live agent the same `HiggsStreamTTSService` sits between the
LLM and the transport:

    Pipeline([transport.input(), stt, user_aggregator, llm, tts, transport.output(), assistant_aggregator])

e.g. with `SmallWebRTCTransport(webrtc_connection, TransportParams(audio_out_enabled=True,
audio_out_sample_rate=24000))` from `pipecat-ai[webrtc]`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import wave
from pathlib import Path

from pipecat.frames.frames import (
    Frame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from higgs_stream.clients.pipecat_service import HiggsStreamTTSService

SAMPLE_RATE = 24000


class WavSink(FrameProcessor):
    """Writes the bot's audio to a mono 16-bit WAV and counts what it saw."""

    def __init__(self, path: str | Path, sample_rate: int = SAMPLE_RATE):
        super().__init__()
        self._wav = wave.open(str(path), "wb")
        self._wav.setnchannels(1)
        self._wav.setsampwidth(2)
        self._wav.setframerate(sample_rate)
        self.sample_rate = sample_rate
        self.samples = 0
        self.contexts: list[str] = []  # context ids of the TTSStartedFrames, in order
        self.stopped = 0  # TTSStoppedFrames seen

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            assert frame.sample_rate == self.sample_rate and frame.num_channels == 1, (
                f"audio at {frame.sample_rate} Hz x{frame.num_channels}, sink wants {self.sample_rate} Hz mono")
            self._wav.writeframes(frame.audio)
            self.samples += len(frame.audio) // 2
        elif isinstance(frame, TTSStartedFrame):
            self.contexts.append(frame.context_id)
        elif isinstance(frame, TTSStoppedFrame):
            self.stopped += 1
        await self.push_frame(frame, direction)

    async def cleanup(self):
        await super().cleanup()
        self._wav.close()


def llm_reply_frames(reply: str) -> list[Frame]:
    """`reply` as an LLM streams it: start, word-sized tokens (spaces kept), end."""
    tokens = re.findall(r"\S+\s*|\s+", reply)
    return [LLMFullResponseStartFrame(), *(LLMTextFrame(t) for t in tokens), LLMFullResponseEndFrame()]


async def speak_reply(url: str, reply: str, out: str | Path, *, token: str | None = None,
                      **options) -> WavSink:
    """Run tts -> WAV sink for one LLM-style reply; returns the sink (samples, contexts)."""
    tts = HiggsStreamTTSService(url=url, token=token, **options)
    sink = WavSink(out)
    worker = PipelineWorker(Pipeline([tts, sink]), params=PipelineParams(audio_out_sample_rate=SAMPLE_RATE),
                            idle_timeout_secs=None)
    await worker.queue_frames([*llm_reply_frames(reply)])
    await worker.stop_when_done()  # EndFrame: waits for the reply's audio context to finish
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await runner.run()
    return sink


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reply", help="the bot's reply text")
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/tts/stream")
    parser.add_argument("--token", default=None)
    parser.add_argument("--voice", default="default")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("-o", "--output", required=True, help="WAV file for the bot's audio")
    args = parser.parse_args(argv)
    sink = asyncio.run(speak_reply(args.url, args.reply, args.output, token=args.token, voice=args.voice,
                                   seed=args.seed))
    print(f"wrote {args.output}: {sink.samples / SAMPLE_RATE:.2f} s in {len(sink.contexts)} context(s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
