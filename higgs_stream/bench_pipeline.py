"""CPU benchmark of the streaming pipeline's host side: a fake engine and a fake codec, N streams.

    python -m higgs_stream.bench_pipeline --streams 256 [--step-ms 7.4] [--codec-ms 10] [--profile]

The fake engine steps, per stream, through the delay-pattern columns of random frames (the BOS
column, the ramp-in, `frames` audio frames, the EOS ramp-out) and emits the codec frames a Higgs
v2 engine's writer makes of them, at the steps a real engine would; `--step-ms` sleeps (GIL released, as a GPU wait would) to stand in for the device
step. The fake codec returns a cheap deterministic waveform of the right shape and sleeps
`--codec-ms` per call. What is measured is the Python around them: routing frames into the
adapters, planning decode windows, PCM conversion and the hand-off to the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.codec.streaming import StepAudio
from higgs_stream.engine.engine import StepEvent
from higgs_stream.engine.errors import CapacityError
from higgs_stream.engine.models.delay_pattern import DelayWriter, delayed_prompt_audio
from higgs_stream.engine.request import GenerationRequest


class FakeEngine:
    """The Engine API the pipeline uses (add, cancel, has_work, step, cfg), with random frames."""

    def __init__(self, step_s: float = 0.0, seed: int = 0, releases: int = 0) -> None:
        """`releases`: tiny torch calls per step, half before and half after the device wait; each
        releases the GIL and takes it back, as the real ModelRunner's staging, attention planning,
        graph replay, event records and copies do (~12 per step)."""
        self.cfg = SimpleNamespace(codebook_size=1024, num_codebooks=8)
        self.releases = releases
        self._scratch = torch.zeros(8)
        self.policy = SimpleNamespace(takes_history=True, speakers=())  # a Higgs family's answers
        self.device = torch.device("cpu")
        self.step_s = step_s
        self._rng = np.random.default_rng(seed)
        self._next = 0
        self._pending: deque[tuple[int, np.ndarray]] = deque()
        self._cancels: deque[int] = deque()
        self._live: dict[int, list] = {}  # sid -> [columns [K, L], next index, its DelayWriter]
        self.frames: dict[int, np.ndarray] = {}  # sid -> every frame it emits [K, F]
        self.busy_s = 0.0  # time spent in step() (sleep included)
        self.steps = 0
        self.paused: set[int] = set()  # live streams left out of steps (Engine.pause)

    def add(self, request: GenerationRequest) -> int:
        sid = self._next
        self._next += 1
        self.frames[sid] = self._rng.integers(0, 1024, size=(8, request.max_frames))
        self._pending.append((sid, delayed_prompt_audio(self.frames[sid])))  # [8, F + 9] columns
        return sid

    def cancel(self, sid: int) -> None:
        self._cancels.append(sid)

    def pause(self, sid: int) -> None:
        if sid in self._live:
            self.paused.add(sid)

    def resume(self, sid: int) -> None:
        self.paused.discard(sid)

    def has_work(self) -> bool:
        return bool(self._pending or self._cancels or len(self._live) > len(self.paused))

    @property
    def num_active(self) -> int:
        return len(self._pending) + len(self._live)

    def step(self, sync: bool = False) -> list[StepEvent]:  # always synchronous
        t0 = time.perf_counter()
        events = []
        while self._pending:
            sid, cols = self._pending.popleft()
            self._live[sid] = [cols, 0, DelayWriter(8, 1024, wrapped=True)]
        while self._cancels:
            sid = self._cancels.popleft()
            if self._live.pop(sid, None) is not None:
                self.paused.discard(sid)
                events.append(StepEvent(sid, None, True, "cancelled"))
        for sid, entry in list(self._live.items()):
            if sid in self.paused:
                continue
            cols, i, writer = entry
            last = i == cols.shape[1] - 1
            frame = writer.push(cols[:, i].tolist(), final=last) if i else None  # column 0: the writer's own BOS
            if frame is not None or last:
                events.append(StepEvent(sid, None if frame is None else np.array(frame, np.int64), last,
                                        "length" if last else None))
            entry[1] = i + 1
            if last:
                del self._live[sid]
        for _ in range(self.releases // 2):
            self._scratch.add_(1.0)
        if self.step_s:
            time.sleep(self.step_s)
        for _ in range(self.releases - self.releases // 2):
            self._scratch.add_(1.0)
        self.steps += 1
        self.busy_s += time.perf_counter() - t0
        return events


class FakeCodec:
    """A frame-local codec (hop 960, 8 x 1024 codes, 24 kHz) with a cheap waveform: frame f's samples
    depend on frame f only, so it is causal and its stateful decoder is a plain decode per push."""

    hop = 960
    receptive_field = 0
    sample_rate = 24000
    geometry = CodecGeometry(num_codebooks=8, codebook_size=1024, hop=960, sample_rate=24000,
                             receptive_field=0, lookahead_samples=0, causal=True)

    def streaming_decoder(self, max_slots: int) -> FrameLocalStreaming:
        return FrameLocalStreaming(self.decode, self.geometry, max_slots)

    def __init__(self, call_s: float = 0.0) -> None:
        self.call_s = call_s
        self.calls = 0
        self.windows = 0
        self.busy_s = 0.0

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        codes = torch.as_tensor(codes)
        out = (codes[:, 0, :].float() / 2048.0).repeat_interleave(self.hop, dim=1)  # [B, F * hop]
        if self.call_s:
            time.sleep(self.call_s)
        self.calls += 1
        self.windows += codes.shape[0]
        self.busy_s += time.perf_counter() - t0
        return out


class FrameLocalStreaming:
    """`StreamingDecoder`'s interface over a frame-local decode function (no state to keep)."""

    def __init__(self, decode, geometry: CodecGeometry, max_slots: int) -> None:
        self.decode, self.geometry, self.max_slots = decode, geometry, max_slots
        self.open_slots: set[int] = set()

    def open(self) -> int:
        free = next((s for s in range(self.max_slots) if s not in self.open_slots), None)
        if free is None:
            raise CapacityError(f"all {self.max_slots} codec stream slots are taken")
        self.open_slots.add(free)
        return free

    def close(self, slot: int) -> None:
        self.open_slots.discard(slot)

    def partition(self, slots, valid, final) -> list[list[int]]:
        return [list(range(len(slots)))]  # no state, no padding cost worth a second call

    def step(self, slots, codes: torch.Tensor, valid, final) -> StepAudio:
        audio = self.decode(codes)  # [B, C * hop]
        return StepAudio(audio, [0] * len(slots), [int(v) * self.geometry.hop for v in valid])


@dataclass
class Result:
    streams: int
    steps: int
    wall_s: float
    loop_ms_per_step: float  # engine-thread time per step outside engine.step()
    step_ms: float  # engine.step() per step (fake: sleep + frame making)
    codec_calls: int
    ttfa_p50_ms: float
    ttfa_p95_ms: float
    underruns: int
    audio_s: float


async def run(streams: int = 256, frames: int = 250, step_ms: float = 0.0, codec_ms: float = 0.0,
              arrival_s: float = 0.0, mode: str = "exact", profile: bool = False, releases: int = 0,
              switch_ms: float | None = None, ramp_repeat: int | None = None) -> tuple[Result, str]:
    from higgs_stream.stream.config import ServerConfig
    from higgs_stream.stream.metrics import UnderrunMeter
    from higgs_stream.stream.handle import Audio
    from higgs_stream.stream.pipeline import Pipeline
    from higgs_stream.stream.messages import ContextOptions
    from higgs_stream.stream.voices import Voice

    engine, codec = FakeEngine(step_ms / 1e3, releases=releases), FakeCodec(codec_ms / 1e3)
    cfg = ServerConfig(max_streams=streams + 8, max_frames=frames, history_segments=0, stream_buffer_s=600.0,
                       admit_step_ratio=None, ramp_repeat=ramp_repeat)  # admission by load would refuse some
    pipeline = Pipeline(engine, codec, cfg)
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        inner = pipeline._run
        pipeline._run = lambda: prof.runcall(inner)
    switch = sys.getswitchinterval()  # the process's, restored after the run (the pipeline sets its own)
    await pipeline.start()
    if switch_ms is not None:  # over the pipeline's own setting, for this run
        sys.setswitchinterval(switch_ms / 1e3)
    loop = asyncio.get_running_loop()

    async def one(i: int) -> dict:
        await asyncio.sleep(arrival_s * i / max(streams, 1))
        h = pipeline.open(ContextOptions(voice=Voice(name="default"), mode=mode, seed=i), transport="bench")
        t0 = loop.time()
        h.say("Hello there, this is a benchmark sentence.")
        h.close()
        meter, first, samples = UnderrunMeter(24000), None, 0
        while True:
            for ev in await h.next(1 << 30):
                now = loop.time()
                if isinstance(ev, Audio):
                    first = now if first is None else first
                    meter.chunk(now, len(ev.pcm) // 2)
                    samples += len(ev.pcm) // 2
                else:
                    return {"ttfa": first - t0, "underruns": meter.underruns, "audio_s": samples / 24000,
                            "reason": ev.reason}

    t0 = time.perf_counter()
    rows = await asyncio.gather(*(one(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    await pipeline.stop()
    sys.setswitchinterval(switch)
    assert all(r["reason"] == "completed" for r in rows), {r["reason"] for r in rows}
    steps = max(engine.steps, 1)
    ttfa = np.array([r["ttfa"] for r in rows]) * 1e3
    res = Result(streams=streams, steps=engine.steps, wall_s=wall,
                 loop_ms_per_step=(pipeline.metrics.step_time.sum - engine.busy_s) / steps * 1e3,
                 step_ms=engine.busy_s / steps * 1e3, codec_calls=codec.calls,
                 ttfa_p50_ms=float(np.percentile(ttfa, 50)), ttfa_p95_ms=float(np.percentile(ttfa, 95)),
                 underruns=sum(r["underruns"] for r in rows), audio_s=sum(r["audio_s"] for r in rows))
    text = ""
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        text = buf.getvalue()
    return res, text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m higgs_stream.bench_pipeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--frames", type=int, default=250)
    ap.add_argument("--step-ms", type=float, default=0.0)
    ap.add_argument("--codec-ms", type=float, default=0.0)
    ap.add_argument("--arrival-s", type=float, default=0.0)
    ap.add_argument("--mode", default="exact")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--releases", type=int, default=0,
                    help="GIL-releasing torch calls per fake engine step (the real ModelRunner makes ~12)")
    ap.add_argument("--switch-ms", type=float, default=None, help="the GIL switch interval (default: the pipeline's)")
    ap.add_argument("--ramp-repeat", type=int, default=None, help="ServerConfig.ramp_repeat (serve --ramp-repeat; default: the family's, here the Higgs one)")
    args = ap.parse_args(argv)
    res, text = asyncio.run(run(args.streams, args.frames, args.step_ms, args.codec_ms, args.arrival_s, args.mode,
                                args.profile, args.releases, args.switch_ms, args.ramp_repeat))
    print(res)
    if text:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
