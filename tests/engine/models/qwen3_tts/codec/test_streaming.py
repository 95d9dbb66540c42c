"""The stateful 12 Hz decoder: streamed == one-shot decode for any push schedule, many streams in one
batched step (ragged widths, padding buckets), slot reuse, and its errors."""

import pytest
import torch
from higgs_stream.engine.errors import CapacityError, ConfigError, InvalidInputError
from higgs_stream.engine.models.qwen3_tts.codec import QwenCodec, load_qwen_codec
from higgs_stream.testing import EXACT_REL_TO_PEAK, rel_to_peak

HOP = 1920


@pytest.fixture(scope="module")
def codec(tiny_dir) -> QwenCodec:
    return load_qwen_codec(tiny_dir)


def codes_for(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (16, frames), generator=torch.Generator().manual_seed(seed))  # [16, F]


def random_schedule(frames: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    sizes, left = [], frames
    while left:
        sizes.append(min(left, int(torch.randint(0, 7, (), generator=gen))))
        left -= sizes[-1]
    return sizes + [0]  # a final push with no frames


@pytest.mark.parametrize("seed", range(4))
def test_streams_in_one_batch_equal_their_one_shot_decodes(codec, seed):
    """Three streams of different lengths pushed together with independent random schedules (ragged
    rows in one step, some rows 0 frames), against each stream's one-shot decode."""
    dec = codec.streaming_decoder(max_slots=4)
    lengths = [13, 1, 22]
    codes = [codes_for(n, 100 * seed + i) for i, n in enumerate(lengths)]
    sched = [random_schedule(n, 10 * seed + i) for i, n in enumerate(lengths)]
    slots = [dec.open() for _ in lengths]
    pos = [0] * 3
    got = [[] for _ in lengths]
    for step in range(max(map(len, sched))):
        rows = [i for i in range(3) if step < len(sched[i])]
        valid = [sched[i][step] for i in rows]
        batch = torch.zeros(len(rows), 16, max(valid + [1]), dtype=torch.long)
        for b, i in enumerate(rows):
            batch[b, :, :valid[b]] = codes[i][:, pos[i]:pos[i] + valid[b]]
            pos[i] += valid[b]
        final = [step == len(sched[i]) - 1 for i in rows]
        for b, pcm in enumerate(dec.push([slots[i] for i in rows], batch, valid, final)):
            assert pcm.numel() == valid[b] * HOP, "a causal decoder yields every pushed frame's samples at once"
            got[rows[b]].append(pcm.clone())
    for i, n in enumerate(lengths):
        want = codec.decode(codes[i][None])[0]
        err = rel_to_peak(torch.cat(got[i]).numpy(), want.numpy())
        assert err <= EXACT_REL_TO_PEAK, f"stream {i} ({n} frames, schedule {sched[i]}): {err:.3g} of peak"


def test_one_frame_at_a_time_crosses_the_attention_window_exactly(codec):
    """40 single-frame pushes (10x the tiny window of 4): the K/V state slides; equal to one-shot."""
    dec = codec.streaming_decoder(max_slots=1)
    codes = codes_for(40, 7)
    slot = dec.open()
    out = [dec.push([slot], codes[None, :, t:t + 1], [1], [t == 39])[0].clone() for t in range(40)]
    want = codec.decode(codes[None])[0]
    assert rel_to_peak(torch.cat(out).numpy(), want.numpy()) <= EXACT_REL_TO_PEAK


def test_padding_buckets_and_slot_reuse(codec):
    """Steps padded to (B, C) buckets give the same audio; a closed slot's next stream starts fresh."""
    dec = codec.streaming_decoder(max_slots=3)
    dec.capture([2, 3], [4, 8], graphs=False)
    codes = codes_for(9, 3)
    want = codec.decode(codes[None])[0]
    for _ in range(2):  # the second stream reuses the first one's slot (its state must not leak)
        slot = dec.open()
        parts = [dec.push([slot], codes[None, :, a:b], [b - a], [b == 9])[0].clone()
                 for a, b in ((0, 3), (3, 8), (8, 9))]
        assert rel_to_peak(torch.cat(parts).numpy(), want.numpy()) <= EXACT_REL_TO_PEAK
        dec.close(slot)
    assert dec.free_slots == 3
    assert dec.partition([dec.open()], [4], [False]) == [[0]]


def test_partition_splits_a_wide_row_from_narrow_ones(codec):
    dec = codec.streaming_decoder(max_slots=8)
    slots = [dec.open() for _ in range(6)]
    groups = dec.partition(slots, [1, 1, 1, 1, 1, 200], [False] * 6)
    assert sorted(sum(groups, [])) == list(range(6))
    assert [5] in groups, f"the 200-frame row should get its own step, got {groups}"


def test_errors(codec):
    dec = codec.streaming_decoder(max_slots=1)
    slot = dec.open()
    with pytest.raises(CapacityError):
        dec.open()
    with pytest.raises(InvalidInputError, match="codes must be"):
        dec.push([slot], torch.zeros(1, 8, 2, dtype=torch.long), [2], [False])
    with pytest.raises(InvalidInputError, match="0..63"):
        dec.push([slot], torch.full((1, 16, 2), 64), [2], [False])
    with pytest.raises(InvalidInputError, match="valid must be"):
        dec.push([slot], torch.zeros(1, 16, 2, dtype=torch.long), [3], [False])
    dec.push([slot], torch.zeros(1, 16, 2, dtype=torch.long), [2], [True])
    with pytest.raises(InvalidInputError, match="after its final"):
        dec.push([slot], torch.zeros(1, 16, 1, dtype=torch.long), [1], [False])
    dec.close(slot)
    with pytest.raises(InvalidInputError, match="not open"):
        dec.close(slot)
    with pytest.raises(ConfigError):
        codec.streaming_decoder(max_slots=0)
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA codec"):
        codec.streaming_decoder(max_slots=1).capture([1], [1], graphs=True)


def test_capture_takes_the_higgs_decoders_arguments(codec):
    """The codec worker calls every family's streaming decoder the same way (`capture(..., stream=)`,
    a green context's stream or None): a signature that drifts fails here, not at a GPU server's start."""
    import inspect

    from higgs_stream.engine.codec.streaming import StreamingDecoder

    ours = inspect.signature(codec.streaming_decoder(2).capture).parameters
    higgs = inspect.signature(StreamingDecoder.capture).parameters
    assert list(ours) == [p for p in higgs if p != "self"]
    assert codec.streaming_decoder(2).capture([1, 2], [1, 4], graphs=False, stream=None) == 0.0


def test_junk_beyond_valid_frames_never_reaches_the_codebooks(codec):
    """Columns past a row's valid frames hold anything (out of range too): the staged step masks them,
    padded to a bucket or not."""
    for buckets in (None, ([2], [8])):
        dec = codec.streaming_decoder(max_slots=2)
        if buckets:
            dec.capture(*buckets, graphs=False)
        codes = codes_for(11, 9)
        slots = [dec.open(), dec.open()]
        out = [[], []]
        for a, b in ((0, 4), (4, 5), (5, 11)):
            batch = torch.full((2, 16, 7), 10_000)
            batch[1, :, :3] = -5
            batch[0, :, :b - a] = codes[:, a:b]
            for i, pcm in enumerate(dec.push(slots, batch, [b - a, 0], [b == 11, False])):
                out[i].append(pcm.clone())
        assert sum(p.numel() for p in out[1]) == 0
        assert rel_to_peak(torch.cat(out[0]).numpy(), codec.decode(codes[None])[0].numpy()) <= EXACT_REL_TO_PEAK


def test_step_cost_prices_a_bucket_by_its_timed_replay(codec):
    dec = codec.streaming_decoder(max_slots=4)
    dec.capture([2, 4], [4, 8], graphs=False)
    modelled = dec.step_cost(3, 5)
    dec.timings = {(4, 8): 1e-4}  # what a graphed capture measures per bucket
    assert dec.step_cost(3, 5) == 1e-4 and dec.step_cost(1, 1) != 1e-4 and modelled > 1e-4
    assert not dec.graphed


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_the_step_is_capturable_on_the_meta_device(size):
    """What a CUDA graph capture needs of `_math`: it runs on tensors without data (no `.item()`, no
    data-dependent shape, no host read); the real capture: test_streaming_gpu.py."""
    from higgs_stream.engine.models.qwen3_tts.codec import FULL
    from higgs_stream.engine.models.qwen3_tts.make_checkpoint import TINY_CODEC

    with torch.device("meta"):
        meta = QwenCodec(TINY_CODEC if size == "tiny" else FULL)
    dec = meta.streaming_decoder(3)
    inp = torch.empty(dec._input_size((2, 5)), dtype=torch.long, device="meta")
    with torch.no_grad(), meta.precision():
        audio = dec._math(inp, (2, 5))
    assert audio.shape == (2, 5 * HOP) and audio.device.type == "meta"


def test_padding_steps_leave_the_open_streams_exact(codec):
    """`run_padding_steps` (the served warm-up's plan-picking pass, engine/gpu_memory.py) between a stream's pushes:
    padding rows touch only the scratch slot, so the stream's audio still equals its one-shot decode."""
    dec = codec.streaming_decoder(max_slots=3)
    codes = codes_for(10, 4)
    slot = dec.open()
    first = dec.push([slot], codes[None, :, :6], [6], [False])[0].clone()
    assert dec.run_padding_steps([1, 3], [2, 5]) == 4
    rest = dec.push([slot], codes[None, :, 6:], [4], [True])[0].clone()
    want = codec.decode(codes[None])[0]
    assert rel_to_peak(torch.cat([first, rest]).numpy(), want.numpy()) <= EXACT_REL_TO_PEAK
