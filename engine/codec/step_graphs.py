"""CUDA graphs of a slot-arena streaming decoder's padded step, shared by the Higgs decoder
(engine/codec/streaming.py) and the Qwen3-TTS 12 Hz decoder (engine/models/qwen3_tts/codec/streaming.py).

A decoder keeps per-stream state in an arena (`states[i]` is [max_slots + 1, ...], the last slot scratch
for padding rows) and runs one batched step over a fixed (B rows, C frames) bucket. Its inputs live in
one static long tensor per bucket: codes [B, Q, C] flattened, then `k` rows of [B] ints (slot, valid,
start, ...); `stage_inputs` fills it with one host-to-device copy. The decoder gives the step as
`body(key) -> output` reading only that tensor and the arena (updated in place), so the step can be
captured once per bucket and replayed. `capture_checked` captures every bucket, checks each replay
against the eager step on random inputs from random arena contents (the arena is restored after), and
drops every graph when one differs by more than CAPTURE_TOLERANCE of peak (logged as an error).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.graph_capture import capture_buckets

log = logging.getLogger(__name__)

CAPTURE_TOLERANCE = 1e-5  # graph replay vs eager step, max |d| / peak (the same kernels run: 0 expected)
TIMED_REPLAYS = 3  # replays timed per bucket after capture (the median prices the bucket)

Key = tuple[int, int]  # (B rows, C frames)


def bucket_keys(batch_buckets: Sequence[int], frame_buckets: Sequence[int], max_slots: int) -> list[Key]:
    """Every (B, C) bucket, sorted; ConfigError for a batch bucket outside 1..max_slots or a frame
    bucket < 1."""
    for b in batch_buckets:
        if not isinstance(b, int) or not 1 <= b <= max_slots:
            raise ConfigError(f"batch buckets must be ints in 1..max_slots={max_slots}, got {b!r}")
    for c in frame_buckets:
        if not isinstance(c, int) or c < 1:
            raise ConfigError(f"frame buckets must be positive ints, got {c!r}")
    return sorted({(b, c) for b in batch_buckets for c in frame_buckets})


def smallest_bucket(buckets: Sequence[Key], n: int, width: int) -> Key | None:
    """The smallest (B, C) bucket that holds n rows of `width` frames (fewest row-frames, then the
    smaller key), if any."""
    fits = [k for k in buckets if k[0] >= n and k[1] >= width]
    return min(fits, key=lambda k: (k[0] * k[1], k)) if fits else None


def input_size(key: Key, num_codebooks: int, meta_rows: int) -> int:
    """Longs in one bucket's static input: codes [B, Q, C] then meta_rows x [B]."""
    b, c = key
    return b * num_codebooks * c + meta_rows * b


def split_inputs(inp: torch.Tensor, key: Key, num_codebooks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bucket's static input as (codes [B, Q, C], meta [k, B]) views."""
    b, c = key
    cut = b * num_codebooks * c
    return inp[:cut].view(b, num_codebooks, c), inp[cut:].view(-1, b)


def stage_inputs(inp: torch.Tensor, key: Key, codes: torch.Tensor, meta: Sequence[Sequence[int]],
                 pads: Sequence[int]) -> None:
    """Write one step's inputs into `inp` (see `split_inputs`): codes [n, Q, >= w] into [:n, :, :w]
    (w = min(its columns, C)), meta row i's n values then pads[i] for the padding rows n..B-1. One
    host-to-device copy from pinned memory when the codes are on the host. Codes outside
    [:n, :, :w] stay unwritten: the step must mask every column beyond a row's valid frames."""
    b, c = key
    n, q = codes.shape[0], codes.shape[1]
    assert len(meta) == len(pads) and all(len(row) == n for row in meta), "one value per row in each meta row"
    assert inp.numel() == input_size(key, q, len(meta)), f"input of {inp.numel()} longs is not bucket {key}'s"
    cut = b * q * c
    host = torch.empty(inp.shape[0], dtype=torch.long, pin_memory=inp.device.type == "cuda")
    rows = host[cut:].view(len(meta), b).numpy()
    for i, (row, pad) in enumerate(zip(meta, pads)):
        rows[i, :n], rows[i, n:] = row, pad
    w = min(codes.shape[2], c)
    if codes.device.type == "cpu":
        host[:cut].view(b, q, c)[:n, :, :w].copy_(codes[:, :, :w])
        inp.copy_(host, non_blocking=True)
    else:
        inp[:cut].view(b, q, c)[:n, :, :w].copy_(codes[:, :, :w])
        inp[cut:].copy_(host[cut:], non_blocking=True)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:  # a layer that keeps no history (Qwen3-TTS's k = s upsampling): nothing to differ
        return 0.0
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def replay_diff(states: Sequence[torch.Tensor], start_states: Sequence[torch.Tensor], rows: int,
                stage: Callable[[], None], eager: Callable[[], torch.Tensor],
                replay: Callable[[], torch.Tensor]) -> float:
    """Max |d| / peak of one replay vs the eager step, output and the first `rows` slots of every
    state, both run with the inputs `stage()` writes from the arena with its first slots set to
    `start_states` (each [>= rows, ...]: the step must write no slot past them)."""

    def run(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for s, r in zip(states, start_states):
            s[:r.shape[0]].copy_(r)
        stage()
        out = fn().clone()
        return out, [s[:rows].clone() for s in states]

    want, want_states = run(eager)
    got, got_states = run(replay)
    return max([_rel(got, want)] + [_rel(g, w) for g, w in zip(got_states, want_states)])


def checked_replays(keys: Sequence[Key], graphs: dict[Key, torch.cuda.CUDAGraph], outputs: dict[Key, torch.Tensor],
                    check: Callable[[Key, torch.cuda.CUDAGraph, torch.Tensor], float],
                    states: Sequence[torch.Tensor]) -> list[float]:
    """`check(key, graph, output)` of each key's graph (max |d| / peak), the arena `states` restored after."""
    saved = [s.clone() for s in states]
    try:
        return [check(key, graphs[key], outputs[key]) for key in keys]
    finally:
        for s, old in zip(states, saved):
            s.copy_(old)


def capture_checked(keys: Sequence[Key], stage_dummy: Callable[[Key], None], body: Callable[[Key], torch.Tensor],
                    check: Callable[[Key, torch.cuda.CUDAGraph, torch.Tensor], float],
                    states: Sequence[torch.Tensor], device: torch.device, stream: torch.cuda.Stream | None,
                    what: str) -> tuple[dict[Key, torch.cuda.CUDAGraph], dict[Key, torch.Tensor], float]:
    """Capture `body(key)` per bucket (engine/graph_capture.capture_buckets), then `check(key, graph,
    output)` each (max |d| / peak vs eager); the arena `states` keep their contents. Returns (graphs,
    outputs, the largest check); above CAPTURE_TOLERANCE no graphs (logged: `what` graphs differ).
    Run it under the decoder's no_grad / precision context."""
    captured, outputs = capture_buckets(keys, stage_dummy, body, device, stream)
    worst = max(checked_replays(keys, captured, outputs, check, states), default=0.0)
    if worst > CAPTURE_TOLERANCE:
        log.error("%s graphs differ from the eager step by %.3g of peak; decoding eagerly", what, worst)
        return {}, {}, worst
    return captured, outputs, worst


def replay_seconds(graph: torch.cuda.CUDAGraph) -> float:
    """Median seconds of TIMED_REPLAYS replays (stage padding-only inputs first: the arena's streams
    must stay untouched)."""
    times = []
    for _ in range(TIMED_REPLAYS):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2]
