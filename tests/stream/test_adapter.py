"""Code2Wav streaming adapter: streamed == one-shot, TTFA, low-latency SNR, playback continuity,
batched decode of many streams, a causal codec through the same code, s16le conversion.

The adapter takes codec frames. The streams here are what a Higgs v2 engine emits: random frames
(with stray BOS/EOS ids) as delay-pattern columns, turned into frames column by column by the
family's writer (engine/models/delay_pattern.DelayWriter), so latencies are counted in engine
columns as a listener sees them.

Exactness is a stated bound, never bit equality (`higgs_stream.testing`): streamed chunks, from the
stateful decoder, alone or batched with other streams joining and leaving, equal the one-shot
decode to max |Δ| <= 1e-5 of the peak on CPU fp32 with either conv backend (~3e-6 measured on
AMD EPYC). A window missing one frame of its left context breaks that bound (~40x) (`test_bound_catches_a_real_seam`).
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

import numpy as np
import pytest
import torch

from higgs_stream.bench_pipeline import FakeCodec
from higgs_stream.engine.codec import CodecConfig, codec_from_state_dict
from higgs_stream.engine.codec.make import build_reference_model
from higgs_stream.engine.errors import ConfigError, InvalidInputError
from higgs_stream.engine.models.delay_pattern import DelayWriter, build_delay_pattern, columns_to_frames
from higgs_stream.stream.adapter import (
    Code2Wav,
    Code2WavAdapter,
    PushJob,
    WindowJob,
    decode_windows,
    to_s16le,
)
from higgs_stream.stream.chunking import (
    LOADED_RAMP,
    LOW_LATENCY_RAMP,
    AdapterConfig,
    first_chunk_frames,
    handover_steps,
    load_schedule,
    loaded_config,
    max_step_ratio,
    window_lengths,
)
from higgs_stream.testing import EXACT_REL_TO_PEAK, assert_audio_close, rel_to_peak

BOS, EOS = 1024, 1025
HOP = 960
LOOKAHEAD = 9458  # samples: the Higgs decoder's look-ahead (engine/codec/streaming.py derives it)
LOW_LATENCY_SNR_FLOOR_DB = 20.0  # whole utterance; measured ~30 dB on the random tiny codec
LOW_LATENCY_FIRST_CHUNK_SNR_FLOOR_DB = 6.0  # 1-frame first chunk with 4 frames of holdback; measured ~12 dB


# ---------------------------------------------------------------- helpers


def segment_columns(rng: np.random.Generator, num_frames: int, stray: float = 0.0) -> np.ndarray:
    """The delay-pattern columns [8, F + 9] of a finished segment with F random frames.

    A fraction `stray` of the codes is BOS/EOS inside real frames (the sanitizer's job).
    """
    frames = rng.integers(0, 1024, size=(8, num_frames), dtype=np.int64)
    if stray:
        mask = rng.random(frames.shape) < stray
        frames[mask] = rng.choice([BOS, EOS], size=int(mask.sum()))
    wrapped = np.concatenate([np.full((8, 1), BOS), frames, np.full((8, 1), EOS)], axis=1)  # [8, F + 2]
    return build_delay_pattern(wrapped)  # [8, F + 9]


def one_shot(codec, cols: np.ndarray, ended: bool = True) -> np.ndarray:
    """The offline path: all columns -> frames -> one codec call."""
    frames = columns_to_frames(cols, ended=ended)  # [8, F]
    return codec.decode(torch.from_numpy(frames)[None])[0].numpy()  # [F * 960]


def engine_frames(cols: np.ndarray, final: bool = True) -> list[tuple[int, np.ndarray | None, bool]]:
    """What an engine emits for these columns, step by step: (column index, frame or None, last) per
    column, through the v2 writer (column 0 is its own BOS column; the last is final when `final`)."""
    writer = DelayWriter(8, 1024, wrapped=True)
    out = []
    for i in range(1, cols.shape[1]):
        last = i == cols.shape[1] - 1
        frame = writer.push(cols[:, i].tolist(), final=final and last)
        out.append((i, None if frame is None else np.array(frame, np.int64), last))
    return out


def stream(adapter: Code2WavAdapter, cols: np.ndarray, final: bool = True) -> list[tuple[int, np.ndarray]]:
    """Push the frames of every column (the stream ends with the last one, like the pipeline: the
    final frame marked final, or `close()`); returns (column index, chunk) pairs."""
    out = []
    for i, frame, last in engine_frames(cols, final):
        if frame is not None:
            out += [(i, chunk) for chunk in adapter.push(frame, final=final and last)]
    out += [(cols.shape[1] - 1, chunk) for chunk in adapter.finish()]
    return out


def joined(chunks: list[tuple[int, np.ndarray]]) -> np.ndarray:
    return np.concatenate([c for _, c in chunks]) if chunks else np.zeros(0, np.float32)


def snr_db(out: np.ndarray, ref: np.ndarray) -> float:
    noise = float(((out.astype(np.float64) - ref) ** 2).sum())
    return float("inf") if noise == 0 else 10 * np.log10(float((ref.astype(np.float64) ** 2).sum()) / noise)


def random_schedule(rng: np.random.Generator) -> AdapterConfig:
    first = int(rng.integers(1, 4))
    sizes = np.sort(rng.integers(first, 31, size=int(rng.integers(0, 6))))
    return AdapterConfig(schedule=(first, *(int(x) for x in sizes)))


@contextlib.contextmanager
def conv_backend(name: str):
    """"onednn": the CPU default; "native": PyTorch's own convs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # mkldnn.flags() also sets TF32 and warns on CPU
        with torch.backends.mkldnn.flags(enabled=name == "onednn"):
            yield


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("backend", ["onednn", "native"])
def test_exact_stream_equals_one_shot_for_random_schedules_and_lengths(codec, backend):
    rng = np.random.default_rng(0)
    lengths = [0, 1, 2, 9, 10, 11, 12, 19, 20, 21, 37, 64, 300, *rng.integers(1, 301, size=3)]
    worst = 0.0
    with conv_backend(backend):
        for n in lengths:
            cfg = AdapterConfig() if n in (64, 300) else random_schedule(rng)
            cols = segment_columns(rng, int(n), stray=0.02)
            adapter = Code2WavAdapter(codec, cfg)
            chunks = stream(adapter, cols)
            out = joined(chunks)
            assert out.dtype == np.float32 and out.shape == (n * HOP,), (n, cfg)
            assert adapter.done and adapter.samples_emitted == n * HOP
            worst = max(worst, assert_audio_close(out, one_shot(codec, cols), what=f"{backend} n={n} {cfg}"))
    print(f"exact streaming ({backend}): max |streamed - one-shot| / peak = {worst:.2e}")


def test_bound_catches_a_real_seam(codec):
    """The exactness bound is tight: a window whose left context lacks one frame (9 instead of the
    receptive field's 10) fails it (by ~40x); with 10 it passes."""
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 1024, size=(8, 60))
    ref = codec.decode(torch.from_numpy(frames)[None])[0].numpy()
    errs = {}
    for left in (9, 10):
        job = WindowJob(frames[:, 30 - left : 41], left=left, new=1)  # frame 30, holdback 10
        (chunk,) = decode_windows(codec.decode, HOP, [job])
        errs[left] = rel_to_peak(chunk, ref[30 * HOP : 31 * HOP]) * np.abs(ref[30 * HOP : 31 * HOP]).max() / np.abs(ref).max()
    assert errs[10] <= EXACT_REL_TO_PEAK < 10 * EXACT_REL_TO_PEAK < errs[9], errs  # measured 0 vs 4.4e-4


def test_cut_short_segment_keeps_every_complete_frame(codec):
    """finish() without a final frame = columns_to_frames(..., ended=False), the offline cut."""
    rng = np.random.default_rng(1)
    cols = segment_columns(rng, 40)[:, :30]  # stopped mid-segment: 30 columns -> 22 frames
    adapter = Code2WavAdapter(codec)
    out = joined(stream(adapter, cols, final=False))
    ref = one_shot(codec, cols, ended=False)
    assert out.shape == ref.shape == (22 * HOP,)
    assert_audio_close(out, ref)
    assert adapter.finish() == []  # idempotent


# ---------------------------------------------------------------- latency and schedule


@pytest.mark.parametrize(("mode", "expected"), [("exact", 19), ("low_latency", 13)])
def test_first_chunk_column_count(codec, mode, expected):
    """TTFA in AR steps: BOS column + 7 delay columns + the frames the first chunk needs: exact 11
    (1 frame + 9458 samples of look-ahead), low-latency 1 + its 4-frame holdback."""
    cfg = AdapterConfig(mode=mode)
    assert first_chunk_frames(cfg, codec.geometry) == expected - 8
    cols = segment_columns(np.random.default_rng(4), 60)
    adapter = Code2WavAdapter(codec, cfg)
    for i, frame, _ in engine_frames(cols)[: expected - 2]:  # columns 1 .. expected - 2
        assert frame is None or adapter.push(frame) == [], i
    i, frame, _ = engine_frames(cols)[expected - 2]  # column expected - 1: the first chunk's last frame
    assert i == expected - 1 and adapter.num_frames == expected - 9
    first = adapter.push(frame)
    want = 11 * HOP - LOOKAHEAD if mode == "exact" else HOP  # every exact sample there is: 1102
    assert len(first) == 1 and first[0].shape == (want,)


def test_chunk_sizes_follow_the_schedule(codec):
    cols = segment_columns(np.random.default_rng(5), 120)
    chunks = stream(Code2WavAdapter(codec), cols)
    sizes = [c.size for _, c in chunks]
    first = 11 * HOP - LOOKAHEAD
    assert sizes[:7] == [first] + [n * HOP for n in (2, 4, 8, 16, 25, 25)]  # then 25s, then the flushed tail
    assert sum(sizes) == 120 * HOP


def playback_stalls(chunks: list[tuple[int, np.ndarray]], step_ms: float) -> tuple[int, float]:
    """A listener that starts playing chunk 0 on arrival; column i (engine step i) arrives at i * step_ms.

    Returns (underruns, total stall ms).
    """
    cursor = None
    underruns, stall = 0, 0.0
    for col_index, chunk in chunks:
        arrival = col_index * step_ms
        if cursor is None:
            cursor = arrival
        elif arrival > cursor + 1e-9:
            underruns, stall, cursor = underruns + 1, stall + arrival - cursor, arrival
        cursor += chunk.size / 24.0  # ms at 24 kHz
    return underruns, stall


@pytest.mark.parametrize("mode", ["exact", "low_latency"])
def test_playback_continuity(codec, mode):
    """No underrun while the talker (+codec) keeps within `max_step_ratio` of real time.

    For the default (doubling) schedule that ratio is about 0.5: a column every 20 ms. At exactly
    real time (a column every 40 ms) every growing schedule stalls: chunk k+1 takes s_k+1 columns
    to generate but chunk k only plays for s_k frames.
    """
    cfg = AdapterConfig(mode=mode)
    rho = max_step_ratio(cfg, codec.geometry)
    assert 0.43 <= rho <= 0.51, rho
    chunks = stream(Code2WavAdapter(codec, cfg), segment_columns(np.random.default_rng(6), 200))
    assert playback_stalls(chunks, step_ms=rho * 40) == (0, 0.0)
    assert playback_stalls(chunks, step_ms=rho * 40 * 0.5)[0] == 0
    assert playback_stalls(chunks, step_ms=(rho + 0.03) * 40)[0] > 0  # the bound is tight
    underruns, stall = playback_stalls(chunks, step_ms=40.0)
    print(f"{mode}: real-time talker -> {underruns} underruns, {stall:.0f} ms of stall")
    assert underruns > 0


@pytest.mark.parametrize("mode", ["exact", "low_latency"])
def test_no_clicks_at_chunk_joins(codec, mode):
    """The largest sample step across a join is no larger than the largest step inside chunks."""
    cols = segment_columns(np.random.default_rng(7), 150)
    chunks = [c for _, c in stream(Code2WavAdapter(codec, mode=mode), cols)]
    inside = max(float(np.abs(np.diff(c)).max()) for c in chunks if c.size > 1)
    joins = [abs(float(b[0]) - float(a[-1])) for a, b in itertools.pairwise(chunks)]
    assert max(joins) <= inside, (max(joins), inside)


# ---------------------------------------------------------------- low-latency mode


def test_low_latency_snr(codec):
    """Ramp chunks (windows with 4-8 frames of holdback) are approximate (SNR floor); from the end
    of the ramp on, the stateful decoder continues and every sample is exact again."""
    cfg = AdapterConfig(mode="low_latency")
    assert cfg.ramp(codec.geometry) == LOW_LATENCY_RAMP
    rng = np.random.default_rng(8)
    totals, firsts = [], []
    for _ in range(4):
        cols = segment_columns(rng, 100)
        ref = one_shot(codec, cols)
        chunks = [c for _, c in stream(Code2WavAdapter(codec, cfg), cols)]
        out = joined([(0, c) for c in chunks])
        totals.append(snr_db(out, ref))
        firsts.append(snr_db(chunks[0], ref[: chunks[0].size]))
        ramp_end = sum(c.size for c in chunks[: len(LOW_LATENCY_RAMP)])
        assert ramp_end == sum(cfg.chunk_size(k) for k in range(len(LOW_LATENCY_RAMP))) * HOP
        assert_audio_close(out[ramp_end:], ref[ramp_end:], what="after the ramp")
    print(f"low-latency SNR: whole {np.mean(totals):.1f} dB, first chunk {np.mean(firsts):.1f} dB")
    assert min(totals) >= LOW_LATENCY_SNR_FLOOR_DB, totals
    assert min(firsts) >= LOW_LATENCY_FIRST_CHUNK_SNR_FLOOR_DB, firsts


@pytest.mark.parametrize("first", [2, 5, 10])
def test_a_loaded_low_latency_plan_windows_its_first_chunk_alone(codec, first):
    """Under load (`loaded_config`, a first chunk of f > 1 frames) low-latency mode decodes chunk 0 alone as a window
    (LOADED_RAMP's 4-frame holdback: out after f + 4 frames, 6 before exact's f + 10) and every later sample from the
    stateful decoder, equal to the one-shot decode; chunk 0 within the first-chunk SNR floor."""
    assert load_schedule(first, 2, 25)[:3] == (first, first, 2 * first)
    cfg = loaded_config("low_latency", first, 2, 25)
    assert cfg.ramp(codec.geometry) == LOADED_RAMP == (4,) and window_lengths(cfg, codec.geometry) == {first + 4}
    assert first_chunk_frames(cfg, codec.geometry) == first + 4 and handover_steps(cfg, codec.geometry) == 10 - 4
    assert first_chunk_frames(loaded_config("exact", first, 2, 25), codec.geometry) == first + 10
    cols = segment_columns(np.random.default_rng(first), 90)
    ref = one_shot(codec, cols)
    chunks = stream(Code2WavAdapter(codec, cfg), cols)
    assert chunks[0][0] == first + 4 + 7 and chunks[0][1].size == first * HOP  # frame n comes with column n + 7
    out = joined(chunks)
    assert out.size == ref.size
    assert_audio_close(out[first * HOP:], ref[first * HOP:], what="after the loaded window")
    assert snr_db(out[:first * HOP], ref[:first * HOP]) >= LOW_LATENCY_FIRST_CHUNK_SNR_FLOOR_DB


def test_an_idle_low_latency_plan_keeps_the_whole_ramp(codec):
    """A first chunk of 1 frame: the default low-latency plan, every LOW_LATENCY_RAMP window (their lengths: the shapes
    a GPU codec warms up); exact mode and a causal codec have no windows."""
    cfg = loaded_config("low_latency", 1, 2, 25)
    assert cfg == AdapterConfig(mode="low_latency") and cfg.ramp(codec.geometry) == LOW_LATENCY_RAMP
    assert window_lengths(cfg, codec.geometry) == {5, 7, 11, 21, 34}  # 1 + 4; 1 + 2 + 4; 3 + 4 + 4; 10 + 4 + 7 ...
    assert window_lengths(AdapterConfig(), codec.geometry) == set()
    assert handover_steps(cfg, codec.geometry) == handover_steps(AdapterConfig(), codec.geometry) == 0
    assert loaded_config("exact", 1, 2, 25).schedule == (1, 1, 2, 4, 8, 16, 25)


# ---------------------------------------------------------------- many streams, one decoder


def test_batched_streams_join_and_leave_and_each_equals_its_one_shot(codec):
    """The pipeline's step loop: every stream gets its next column, then ONE `Code2Wav.run` for all
    due jobs (one stateful step, plus the ramp windows); streams start late, end, and new ones
    reuse the freed decoder slots."""
    rng = np.random.default_rng(9)
    specs = [  # (frames, start step, config)
        (120, 0, AdapterConfig()), (90, 0, AdapterConfig()), (5, 3, AdapterConfig()),
        (150, 7, AdapterConfig()), (70, 2, AdapterConfig(mode="low_latency")),
        (100, 11, AdapterConfig(schedule=(2, 6, 25))), (40, 140, AdapterConfig()), (0, 4, AdapterConfig()),
    ]
    cols = [segment_columns(rng, n, stray=0.02) for n, _, _ in specs]
    frames = [engine_frames(c) for c in cols]
    runner = Code2Wav(codec, max_slots=5)  # fewer slots than streams: the late ones reuse freed slots
    adapters = [Code2WavAdapter(codec.geometry, cfg) for _, _, cfg in specs]
    outs: list[list[np.ndarray]] = [[] for _ in specs]
    shared = 0
    steps = max(st + len(c) for (_, st, _), c in zip(specs, frames))
    for step in range(steps):
        jobs, owners = [], []
        for s, ((_, st, _), c, a) in enumerate(zip(specs, frames, adapters)):
            i = step - st
            if 0 <= i < len(c):
                _, frame, last = c[i]
                if frame is not None:
                    a.feed(frame, final=last)
                elif last:
                    a.close()
                for job in a.take_jobs():
                    jobs.append(job)
                    owners.append(s)
        for s, chunk in zip(owners, runner.run(owners, jobs)):
            outs[s].append(chunk)
        shared += sum(isinstance(j, PushJob) for j in jobs) > 1
        assert runner.open_streams <= 5
    assert shared > 0 and runner.open_streams == 0
    for (n, _, cfg), c, a, out in zip(specs, cols, adapters, outs):
        assert a.done
        got = np.concatenate(out) if out else np.zeros(0, np.float32)
        # exact: the one-shot decode; low-latency: the same chunks decoded for this stream alone
        want = one_shot(codec, c) if cfg.mode == "exact" else joined(stream(Code2WavAdapter(codec, cfg), c))
        assert_audio_close(got, want, what=f"n={n} {cfg.mode}")


def test_pushes_wider_than_the_largest_bucket_are_split_and_stay_exact(codec):
    """A codec behind its streams gets pushes of many frames from many streams at once; Code2Wav splits
    them into steps that fit the decoder's largest (streams, frames) bucket (here 2 x 3, padded eager
    steps on the CPU; graph replays on a GPU) instead of one eager step of any size, and each stream
    still equals its one-shot decode."""
    rng = np.random.default_rng(12)
    cols = [segment_columns(rng, n) for n in (23, 9, 1, 14)]
    runner = Code2Wav(codec, max_slots=4)
    runner.streaming.capture((1, 2), (1, 3), graphs=False)
    assert runner.streaming.largest_step == (2, 3)
    # no more rows x frames than the largest bucket: one (eager) step; more: pieces in frame order
    assert runner._pieces([0, 1, 2], [2, 2, 1], [False] * 3) == [[(0, 2, 0), (1, 2, 0), (2, 1, 0)]]
    assert runner._pieces([0, 1], [5, 0], [True, True]) == [[(0, 2, 0), (1, 0, 0)], [(0, 3, 2)]]
    adapters = [Code2WavAdapter(codec.geometry, AdapterConfig(schedule=(25,))) for _ in cols]
    jobs, owners = [], []
    for s, (c, a) in enumerate(zip(cols, adapters)):
        for _, frame, last in engine_frames(c):
            if frame is not None:
                a.feed(frame, final=last)
            elif last:
                a.close()
        jobs += a.take_jobs()
        owners += [s] * (len(jobs) - len(owners))
    steps0 = runner.steps
    outs = runner.run(owners, jobs)
    assert runner.steps - steps0 > 4 and runner.open_streams == 0  # split: more steps than streams
    for s, c in enumerate(cols):
        got = np.concatenate([o for o, w in zip(outs, owners) if w == s])
        assert_audio_close(got, one_shot(codec, c), what=f"stream {s}")


def test_a_final_push_wider_than_the_buckets_runs_in_bucketed_pieces_and_stays_exact(codec):
    """A stream whose held pushes join its final one (a codec that holds jobs until they are due) has more frames
    than the widest bucket once its flush (the look-ahead's 10 frames) runs with them. On a GPU (`eager_step_s`
    STEP_EAGER_S) Code2Wav cuts its frames so that every step fits a bucket, the final piece short enough for the
    flush (here buckets of up to 12 frames: at most 2 frames with the flush), instead of one eager step at the row's
    own width (H200: 14-86 ms against a few for graphed pieces); many rows too wide stay one eager step where the
    pieces would pad to batch buckets and cost more (the step model); on a CPU (every step eager, no extra cost) one
    step; the stream equals its one-shot decode either way."""
    from higgs_stream.engine.codec.arena import STEP_EAGER_S

    runner = Code2Wav(codec, max_slots=64)
    runner.streaming.capture((1, 2, 4, 8, 16, 32, 64), (4, 12), graphs=False)
    assert runner.streaming.largest_step == (64, 12) and codec.geometry.lookahead_frames == 10
    assert runner.eager_step_s == 0.0  # a CPU codec
    assert runner._pieces([0], [5], [True]) == [[(0, 5, 0)]]  # the model: one eager step is the cheaper
    runner.eager_step_s = STEP_EAGER_S  # as on a GPU
    assert runner._pieces([0], [5], [False]) == [[(0, 5, 0)]]  # within a bucket
    assert runner._pieces([0], [5], [True]) == [[(0, 3, 0)], [(0, 2, 3)]]
    assert runner._pieces([0, 1], [2, 30], [True, False]) == [[(0, 2, 0), (1, 12, 0)], [(1, 6, 12)], [(1, 12, 18)]]
    rows = list(range(40))  # 40 rows of 15 frames: the pieces (3 + 12) pad to 64-row buckets; one eager step is cheaper
    assert runner._pieces(rows, [15] * 40, [False] * 40) == [[(r, 15, 0) for r in rows]]
    cols = segment_columns(np.random.default_rng(13), 23)
    ref = one_shot(codec, cols)
    for eager_step_s, want in ((STEP_EAGER_S, [[12], [9], [12]]), (0.0, [[33]])):  # 12, 9, then 2 + the flush
        runner.eager_step_s = eager_step_s
        adapter = Code2WavAdapter(codec.geometry, AdapterConfig(schedule=(25,)))
        for _, frame, last in engine_frames(cols):
            if frame is not None:
                adapter.feed(frame, final=last)
            elif last:
                adapter.close()
        jobs = adapter.take_jobs()
        assert len(jobs) == 1 and jobs[0].push.final and jobs[0].push.frames == 23
        widths, step = [], runner.streaming.step
        runner.streaming.step = lambda slots, codes, valid, final, step=step: (
            widths.append(runner.streaming.widths(slots, valid, final)) or step(slots, codes, valid, final))
        out = runner.run([0], jobs)
        runner.streaming.step = step
        assert widths == want
        assert_audio_close(out[0], ref)


def test_released_streams_free_their_slot(codec):
    """A segment that ends without its final push (cancelled) frees its slot through release()."""
    runner = Code2Wav(codec, max_slots=1)
    a = Code2WavAdapter(codec.geometry)
    cols = segment_columns(np.random.default_rng(10), 30)
    jobs = []
    for _, frame, _ in engine_frames(cols)[:19]:  # columns 1..19
        if frame is not None:
            a.feed(frame)
            jobs += a.take_jobs()
    runner.run(["a"] * len(jobs), jobs)
    assert runner.open_streams == 1
    runner.release("a")
    assert runner.open_streams == 0
    b = Code2WavAdapter(codec.geometry)
    for _, frame, _ in engine_frames(cols):
        if frame is not None:
            b.feed(frame)
    b.close()  # a v2 stream's last column yields no frame: the pipeline closes the adapter
    out = runner.run(["b"], b.take_jobs())
    assert_audio_close(np.concatenate(out), one_shot(codec, cols))


def test_a_causal_codec_streams_through_the_same_code():
    """A causal codec (no look-ahead; the frame-local FakeCodec's geometry, as Qwen3-TTS's 12 Hz
    codec will declare) gets its first chunk as soon as one frame is known, no ramp, and chunks
    of exactly the schedule's frames."""
    codec = FakeCodec()
    for mode in ("exact", "low_latency"):
        cfg = AdapterConfig(mode=mode)
        assert first_chunk_frames(cfg, codec.geometry) == 1 and cfg.ramp(codec.geometry) == ()
        cols = segment_columns(np.random.default_rng(11), 60)
        chunks = stream(Code2WavAdapter(codec, cfg), cols)
        assert chunks[0][0] == 8 and [c.size // HOP for _, c in chunks][:6] == [1, 2, 4, 8, 16, 25]
        frames = torch.from_numpy(columns_to_frames(cols))[None]
        assert np.array_equal(joined(chunks), codec.decode(frames)[0].numpy())  # frame-local: no rounding


# ---------------------------------------------------------------- validation and PCM


def test_config_validation(codec):
    for bad in (
        {"ramp_holdbacks": (4,)},  # a ramp in exact mode
        {"mode": "fast"},
        {"schedule": (4, 2)},
        {"schedule": ()},
        {"schedule": (0, 2)},
        {"ramp_holdbacks": (-1,), "mode": "low_latency"},
    ):
        with pytest.raises(ConfigError):
            AdapterConfig(**bad)
    with pytest.raises(ConfigError):  # a holdback that covers the look-ahead is no ramp: use exact mode
        AdapterConfig(mode="low_latency", ramp_holdbacks=(10,)).ramp(codec.geometry)
    cfg = AdapterConfig(schedule=(1, 3))
    assert [cfg.chunk_size(k) for k in range(4)] == [1, 3, 3, 3]
    assert AdapterConfig(mode="low_latency", ramp_holdbacks=(2, 9)).ramp(codec.geometry) == (2, 9)


def test_adapter_rejects_bad_input(codec):
    with pytest.raises(ConfigError):
        Code2WavAdapter(codec, AdapterConfig(), mode="exact")
    with pytest.raises(ConfigError):
        Code2WavAdapter(42)
    adapter = Code2WavAdapter(codec)
    # frames hold real codes only (the engine's writer replaced stray BOS/EOS): 1024 is no code
    for bad in (np.full(7, 0), np.full(8, 3.0), np.full(8, BOS), np.full(8, -1)):
        with pytest.raises(InvalidInputError):
            adapter.push(bad)
    assert adapter.num_frames == 0
    adapter.push(np.zeros(8, np.int64), final=True)
    with pytest.raises(InvalidInputError):
        adapter.push(np.zeros(8, np.int64))
    planner_only = Code2WavAdapter(codec.geometry)
    for frame in np.random.default_rng(12).integers(0, 1024, size=(20, 8)):
        planner_only.feed(frame)
    with pytest.raises(ConfigError):  # over a geometry it plans; Code2Wav decodes
        planner_only.finish()


def test_s16le_values():
    x = np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, -0.5, 0.25, 1 / 32767, -1e-9], np.float32)
    got = np.frombuffer(to_s16le(x), dtype="<i2")
    # 0.5 * 32767 = 16383.5 is a tie: round half to even -> 16384; 0.25 * 32767 = 8191.75 -> 8192
    assert got.tolist() == [0, 32767, -32767, 32767, -32767, 16384, -16384, 8192, 1, 0]
    assert to_s16le(np.array([1.0], np.float32)) == b"\xff\x7f"
    assert to_s16le(np.zeros(0, np.float32)) == b""
    for bad in (np.array([np.nan], np.float32), np.array([np.inf]), np.zeros((2, 3), np.float32)):
        with pytest.raises(InvalidInputError):
            to_s16le(bad)


# ---------------------------------------------------------------- the pipeline's batched helpers


def test_feed_frames_equals_feed_and_isolates_a_bad_stream(codec):
    from higgs_stream.stream.adapter import feed_frames

    rng = np.random.default_rng(6)
    frames = [rng.integers(0, 1024, size=(8, n)) for n in (30, 12, 30)]
    one = [Code2WavAdapter(codec.geometry) for _ in frames]
    many = [Code2WavAdapter(codec.geometry) for _ in frames]
    for i in range(30):
        live = [s for s, f in enumerate(frames) if i < f.shape[1]]
        finals = [i == frames[s].shape[1] - 1 for s in live]
        for s, final in zip(live, finals):
            one[s].feed(frames[s][:, i], final=final)
        assert feed_frames([many[s] for s in live], np.stack([frames[s][:, i] for s in live]), finals) == [None] * len(live)
        for s in live:
            a, b = one[s].take_jobs(), many[s].take_jobs()
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert type(x) is type(y) and np.array_equal(x.codes, y.codes)
    # a stream that already ended is refused alone; a bad array is refused before any change
    fresh = [Code2WavAdapter(codec.geometry), Code2WavAdapter(codec.geometry)]
    fresh[1].close()
    errors = feed_frames(fresh, np.zeros((2, 8), np.int64), [False, False])
    assert errors[0] is None and isinstance(errors[1], InvalidInputError)
    assert fresh[0].num_frames == 1 and fresh[1].num_frames == 0
    with pytest.raises(InvalidInputError):
        feed_frames(fresh, np.stack([np.zeros(8, np.int64), np.full(8, 1024)]), [False, False])
    assert fresh[0].num_frames == 1


def test_jobs_to_s16le_equals_to_s16le():
    from higgs_stream.stream.adapter import jobs_to_s16le

    rng = np.random.default_rng(7)
    chunks = [rng.normal(0, 0.6, n).astype(np.float32) for n in (960, 0, 2880, 17)]
    assert jobs_to_s16le(chunks) == [to_s16le(c) for c in chunks]
    chunks[2][5] = np.nan
    got = jobs_to_s16le(chunks)
    assert got[2] is None and got[:2] == [to_s16le(c) for c in chunks[:2]] and got[3] == to_s16le(chunks[3])
    assert jobs_to_s16le([]) == []


def test_exact_mode_takes_its_context_from_the_codec():
    """README's `Code2WavAdapter(codec, mode="exact")` on a codec whose receptive field is not the
    released codec's 10 frames: the adapter's windows follow the codec, so the stream stays exact."""
    cfg = CodecConfig.tiny(decoder_ratios=(4, 4, 4, 15), encoder_ratios=(4, 4, 4, 15))
    codec = codec_from_state_dict(build_reference_model(cfg, seed=3).state_dict(), cfg, with_encoder=False)
    assert codec.receptive_field == cfg.receptive_field == 17
    adapter = Code2WavAdapter(codec, mode="exact")
    assert adapter.geometry.receptive_field == 17
    cols = segment_columns(np.random.default_rng(5), 70)
    assert_audio_close(joined(stream(adapter, cols)), one_shot(codec, cols))
