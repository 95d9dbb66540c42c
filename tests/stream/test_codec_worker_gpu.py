"""The codec thread on CUDA with `overdue_first`: calls that hold an overdue job (first chunks) run on
the highest-priority stream, the others on the codec's own; the decoder state both streams touch stays
ordered, so every segment's audio equals the audio of the plain worker exactly (same kernels, same
shapes, one device)."""

from __future__ import annotations

import asyncio
import time
import numpy as np
import pytest
import torch

from higgs_stream.engine.codec import Codec, CodecConfig
from higgs_stream.engine.random_weights import random_codec
from higgs_stream.stream.adapter import Code2WavAdapter
from higgs_stream.stream.codec_worker import CodecWorker, Round

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class Seg:
    """A pipeline segment as the codec thread sees one: opaque, hashable by identity, with a `sid`."""

    def __init__(self, sid: int) -> None:
        self.sid = sid


async def run_worker(codec: Codec, overdue_first: bool, frames: list[np.ndarray]) -> tuple[dict, list]:
    """Three segments fed frame by frame, each one's first jobs due at once (overdue), the rest 1 s on."""
    audio: dict[int, list[bytes]] = {}
    ended = asyncio.Event()

    def deliver(items: list[tuple]) -> None:
        for item in items:
            if item[0] == "audio":
                audio.setdefault(item[1].sid, []).append(item[2])
                continue
            assert item[0] == "end" and item[3] is None, item  # no decode failure
            if item[1].sid == len(frames) - 1:
                ended.set()

    w = CodecWorker(codec, cancel=lambda sid: None, deliver=deliver, max_streams=4, overdue_first=overdue_first)
    w.trace = []
    await w.start(None)
    segs = [Seg(i) for i in range(len(frames))]
    adapters = [Code2WavAdapter(codec, mode="exact") for _ in frames]
    for t in range(max(f.shape[1] for f in frames)):
        jobs, owners, deadlines, now = [], [], [], time.monotonic()
        for seg, a, f in zip(segs, adapters, frames):
            if t < f.shape[1]:
                a.feed(f[:, t], final=t == f.shape[1] - 1)
                for job in a.take_jobs():
                    jobs.append(job)
                    owners.append(seg)
                    deadlines.append(now if t < 12 else now + 1.0)
        ends = [("end", s, "stop", None, f.shape[1]) for s, f in zip(segs, frames) if t == f.shape[1] - 1]
        assert w.submit(Round(jobs, owners, ends, deadlines), timeout=10.0)
    await asyncio.wait_for(ended.wait(), 60.0)
    await w.stop(10.0)
    return {sid: b"".join(parts) for sid, parts in audio.items()}, w.trace


def test_overdue_calls_on_the_first_stream_give_the_same_audio():
    codec = random_codec(CodecConfig.tiny())
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 1024, size=(8, n)) for n in (40, 25, 60)]
    plain, _ = asyncio.run(run_worker(codec, False, frames))
    first, trace = asyncio.run(run_worker(codec, True, frames))
    assert sorted(first) == [0, 1, 2] and all(len(first[s]) > 0 for s in first)
    assert first == plain
    overdue = [t[-1] for t in trace]
    assert any(overdue) and not all(overdue)  # both streams were used


def test_the_served_warm_up_keeps_the_qwen_codec_exact_at_16_streams():
    """The codec worker's warm-up as a server runs it (its GPU memory bound: engine/gpu_memory.py): on an idle H200
    cuDNN otherwise ran a ~80 GB-workspace plan for the full-size Qwen3-TTS decoder's first block at 16 streams x 2
    frames that returned wrong audio (session 18). After the warm-up, that step replayed from its CUDA graph equals
    the same step with cuDNN off (PyTorch's native convolutions) to fp32 rounding, audio and state."""
    from higgs_stream.engine.codec.step_graphs import replay_diff
    from higgs_stream.engine.models.qwen3_tts.codec import FULL, QwenCodec
    from higgs_stream.engine.models.qwen3_tts.make_checkpoint import random_decoder

    codec = random_decoder(QwenCodec(FULL), 0).cuda()
    w = CodecWorker(codec, cancel=lambda sid: None, deliver=lambda items: None, max_streams=8, memory_headroom_gb=16.0)
    asyncio.run(w.start(None))
    try:
        dec = w.code2wav.streaming
        key = (16, 2)
        assert dec.graphed and key in dec._graphs and codec.cudnn  # no fallback needed under the bound
        assert w.native_check is not None and w.native_check < 1e-4  # every small bucket vs native convolutions
        gen = torch.Generator().manual_seed(3)
        codes = torch.randint(0, 2048, (16, 16, 2), generator=gen)
        start_states = [torch.randn(s[:16].shape, generator=gen).mul_(0.1).cuda() for s in dec.states]
        stage = lambda: dec._stage(dec._inputs[key], key, list(range(16)), codes, [2] * 16, [0] * 8 + [5] * 8)  # noqa: E731

        def native():
            with torch.backends.cudnn.flags(enabled=False), torch.no_grad(), codec.precision():
                return dec._math(dec._inputs[key], key)

        def replay():
            dec._graphs[key].replay()
            return dec._outputs[key]

        assert replay_diff(dec.states, start_states, 16, stage, native, replay) < 1e-5
    finally:
        asyncio.run(w.stop(10.0))
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
