"""Incremental Code2Wav (engine/codec/streaming.py): streamed == one-shot decode on a tiny codec with the
real Higgs v2 geometry, for any push schedule, many streams in one batch, slot reuse and errors."""

import math

import pytest
import torch
from higgs_stream.engine.codec import (
    Codec,
    CodecConfig,
    CodecGeometry,
    StreamingDecoder,
    codec_from_state_dict,
    lookahead_samples,
)
from higgs_stream.engine.codec.decoder import (
    DILATIONS,
    AcousticDecoder,
    influence_interval,
)
from higgs_stream.engine.codec.make import build_reference_model
from higgs_stream.engine.errors import CapacityError, ConfigError, InvalidInputError

HOP = 960
LOOKAHEAD = 9458  # samples; research/peers_2026-11.md §2.1: 3*960 + 43*120 + 42*24 + 41*6 + 40*3 + 41 + 3
BOUND = 1e-5  # max |streamed - one-shot| / peak; fp32 one-shot itself is ~3e-6 of peak from fp64


@pytest.fixture(scope="module")
def codec() -> Codec:
    cfg = CodecConfig.tiny()
    return codec_from_state_dict(build_reference_model(cfg, seed=7).state_dict(), cfg, with_encoder=False)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"streamed {tuple(got.shape)} vs one-shot {tuple(want.shape)}"
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / want.abs().max())


def random_codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1024, (8, frames), generator=torch.Generator().manual_seed(seed))  # [8, F]


def schedule(kind: str, frames: int, seed: int) -> list[int]:
    """Push sizes that add up to `frames` (the final push may carry 0 frames)."""
    if kind == "ones":
        return [1] * frames or [0]
    if kind == "big":
        return [frames] if frames < 20 else [frames - 1, 1]
    gen = torch.Generator().manual_seed(seed)
    sizes, left = [], frames
    while left:
        sizes.append(min(left, int(torch.randint(0, 13, (), generator=gen))))
        left -= sizes[-1]
    return sizes + [0]  # end with a final push of no frames


def stream(dec: StreamingDecoder, codes: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    slot, pos, out = dec.open(), 0, []
    try:
        for i, n in enumerate(sizes):
            out += dec.push([slot], codes[None, :, pos:pos + n], [n], [i == len(sizes) - 1])
            pos += n
    finally:
        dec.close(slot)
    return torch.cat(out)


# ---------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("cfg", [CodecConfig.tiny(), CodecConfig.full()], ids=["tiny", "full"])
def test_lookahead_from_the_module_structure(cfg):
    dec = AcousticDecoder(cfg)  # full size: modules only, nothing is decoded
    assert lookahead_samples(dec) == LOOKAHEAD
    for f in (11, 500):  # frame f first reaches output sample f*hop - lookahead
        lo, _ = influence_interval(cfg, f)
        assert f * cfg.hop - lo == LOOKAHEAD


def test_codec_geometry_and_state_size():
    codec = Codec(CodecConfig.full(), with_encoder=False)
    g = codec.geometry
    assert (g.num_codebooks, g.codebook_size, g.hop, g.sample_rate) == (8, 1024, 960, 24000)
    assert (g.receptive_field, g.lookahead_samples, g.lookahead_frames, g.causal) == (10, LOOKAHEAD, 10, False)
    assert g.frame_seconds == 0.04
    # per stream: conv1 (D x 6) + per block ConvT (C_in x 1) and 3 residual units (C_out x 6d) + final conv (32 x 6)
    cfg = codec.cfg
    floats = cfg.acoustic_dim * 6 + 32 * 6
    for i in range(len(cfg.decoder_ratios)):
        c_in = cfg.decoder_hidden_size // 2**i
        floats += c_in + c_in // 2 * 6 * sum(DILATIONS)
    assert StreamingDecoder(codec, 2).state_bytes_per_stream == 4 * floats == 324352


def test_geometry_validation_and_a_causal_codec():
    qwen = CodecGeometry(num_codebooks=16, codebook_size=2048, hop=1920, sample_rate=24000, receptive_field=25,
                         lookahead_samples=0, causal=True)
    assert qwen.lookahead_frames == 0 and qwen.frame_seconds == 0.08
    ok = {"num_codebooks": 8, "codebook_size": 1024, "hop": 960, "sample_rate": 24000, "receptive_field": 10,
          "lookahead_samples": LOOKAHEAD, "causal": False}
    assert CodecGeometry(**ok).lookahead_frames == math.ceil(LOOKAHEAD / HOP) == 10
    for bad in [{"hop": 0}, {"num_codebooks": -1}, {"sample_rate": 24000.0}, {"receptive_field": -1},
                {"lookahead_samples": -5}, {"causal": True}, {"lookahead_samples": 0}, {"causal": 1}]:
        with pytest.raises(ConfigError):
            CodecGeometry(**{**ok, **bad})


# ---------------------------------------------------------------------------- one stream
@pytest.mark.parametrize("frames", [0, 1, 2, 5, 9, 10, 11, 17, 40, 64])
def test_streamed_equals_one_shot(codec, frames):
    codes = random_codes(frames, seed=frames)
    want = codec.decode(codes[None])[0]  # [F * hop]
    dec = StreamingDecoder(codec, max_slots=1)
    kinds = ["ones", "mixed", "big"] if frames <= 17 else ["mixed", "big"]
    for kind in kinds:
        got = stream(dec, codes, schedule(kind, frames, seed=frames))
        assert got.shape == (frames * HOP,) and got.dtype == torch.float32
        err = rel_err(got, want)
        assert err <= BOUND, f"{frames} frames, {kind} pushes: max |d| / peak = {err:.3g}"


def test_one_frame_pushes_of_a_long_utterance(codec):
    codes = random_codes(70, seed=70)
    want = codec.decode(codes[None])[0]
    err = rel_err(stream(StreamingDecoder(codec, max_slots=1), codes, schedule("ones", 70, 0)), want)
    assert err <= BOUND, f"max |d| / peak = {err:.3g}"


def test_emission_lags_by_the_lookahead(codec):
    """Non-final pushes return exactly [emitted, frames*hop - lookahead); the final one the rest."""
    dec = StreamingDecoder(codec, max_slots=1)
    slot, codes = dec.open(), random_codes(30, seed=1)
    (out,) = dec.push([slot], codes[None, :, :9], [9], [False])
    assert out.shape == (0,)  # 9 frames = 8640 samples < 9458 samples of look-ahead
    for a, b in [(9, 10), (10, 11), (11, 25)]:
        (out,) = dec.push([slot], codes[None, :, a:b], [b - a], [False])
        assert out.shape[0] == max(0, b * HOP - LOOKAHEAD) - max(0, a * HOP - LOOKAHEAD)
    (out,) = dec.push([slot], codes[None, :, 25:], [5], [True])
    assert out.shape[0] == 30 * HOP - (25 * HOP - LOOKAHEAD)


# ---------------------------------------------------------------------------- many streams
def test_batched_streams_with_different_progress_joining_and_leaving(codec):
    """4 slots, 7 utterances: each step pushes a random subset with random valid counts in a padded
    [B, 8, C] tensor whose columns beyond `valid` are junk (out of range); steps are padded to buckets
    (padding rows on the scratch slot). Each utterance equals its own one-shot decode."""
    gen = torch.Generator().manual_seed(5)
    lengths = [23, 0, 41, 1, 12, 30, 7]
    utts = [random_codes(f, seed=100 + i) for i, f in enumerate(lengths)]
    dec = StreamingDecoder(codec, max_slots=4)
    dec.capture([2, 4], [4, 16], graphs=False)  # eager, padded like the graphs would be
    waiting, live, out = list(range(len(utts))), {}, {i: [] for i in range(len(utts))}
    slot_of, padded = {}, 0
    while waiting or live:
        while waiting and dec.free_slots and torch.rand((), generator=gen) < 0.7:
            u = waiting.pop(0)
            slot_of[u] = dec.open()
            live[u] = 0  # frames pushed
        rows = [u for u in live if torch.rand((), generator=gen) < 0.8]
        if not rows:
            continue
        width = int(torch.randint(1, 6, (), generator=gen))
        codes = torch.full((len(rows), 8, width), 5000, dtype=torch.long)  # junk beyond valid
        valid, final = [], []
        for r, u in enumerate(rows):
            v = min(int(torch.randint(0, width + 1, (), generator=gen)), lengths[u] - live[u])
            codes[r, :, :v] = utts[u][:, live[u]:live[u] + v]
            live[u] += v
            valid.append(v)
            final.append(live[u] == lengths[u] and bool(torch.rand((), generator=gen) < 0.5))
        width = max(dec.widths([slot_of[u] for u in rows], valid, final))
        padded += dec._bucket(len(rows), width) not in (None, (len(rows), width))  # a padded bucket ran
        step = dec.step([slot_of[u] for u in rows], codes, valid, final)
        assert step.audio.shape[0] == len(rows)
        for r, u in enumerate(rows):
            out[u].append(step.audio[r, step.offsets[r]:step.offsets[r] + step.counts[r]].clone())
            if final[r]:
                dec.close(slot_of[u])
                del live[u]
    assert dec.free_slots == 4 and padded > 0  # some steps had padding rows and padding columns
    for u, codes in enumerate(utts):
        want = codec.decode(codes[None])[0]
        err = rel_err(torch.cat(out[u]), want)
        assert err <= BOUND, f"utterance {u} ({lengths[u]} frames): max |d| / peak = {err:.3g}"


def test_partition_splits_a_step_only_where_padding_costs_more_than_a_launch(codec):
    """Padded to its widest row, a step of 20 one-frame rows and one final push (1 + 10 flush frames)
    costs the model 2 + 32 x (0.11 + 11 x 0.027) = 15.0 ms; two steps cost (2 + 32 x 0.137) + (2 + 1 x 0.407)
    = 8.8 ms: split. Equal widths never split; pushing the groups one after the other gives each stream
    its one-shot decode."""
    dec = StreamingDecoder(codec, max_slots=32)
    dec.capture([1, 2, 4, 8, 16, 32], [1, 2, 4, 8, 16], graphs=False)
    assert dec.timings == {}  # nothing timed without graphs: the STEP_* model prices steps
    assert dec.step_cost(20, 1) == pytest.approx(2.0e-3 + 32 * (0.11e-3 + 0.027e-3))
    slots = [dec.open() for _ in range(21)]
    assert dec.partition(slots, [1] * 21, [False] * 21) == [list(range(21))]
    valid, final = [1] * 20 + [1], [False] * 20 + [True]
    assert dec.widths(slots, valid, final) == [1] * 20 + [11]
    assert dec.partition(slots, valid, final) == [list(range(20)), [20]]
    # a row that is fresh and final with no frames runs nothing: it joins the narrow group
    assert dec.partition(slots[:3], [0, 2, 2], [True, False, False]) == [[0, 1, 2]]
    for s in slots:
        dec.close(s)
    # mixed widths through partitioned steps: each stream equals its own one-shot decode
    utts = [random_codes(f, seed=300 + i) for i, f in enumerate([3, 30, 17, 1, 26])]
    slots = [dec.open() for _ in utts]
    outs, done = {i: [] for i in range(len(utts))}, [0] * len(utts)
    sizes = [[1, 2], [1, 2, 4, 8, 15], [16, 1], [1], [25, 1]]
    for k in range(max(map(len, sizes))):
        rows = [i for i in range(len(utts)) if k < len(sizes[i])]
        valid = [sizes[i][k] for i in rows]
        final = [k == len(sizes[i]) - 1 for i in rows]
        groups = dec.partition([slots[i] for i in rows], valid, final)
        assert sorted(r for g in groups for r in g) == list(range(len(rows)))
        for g in groups:
            width = max(valid[r] for r in g)
            codes = torch.zeros((len(g), 8, width), dtype=torch.long)
            for b, r in enumerate(g):
                i = rows[r]
                codes[b, :, :valid[r]] = utts[i][:, done[i]:done[i] + valid[r]]
                done[i] += valid[r]
            for b, piece in enumerate(dec.push([slots[rows[r]] for r in g], codes, [valid[r] for r in g],
                                               [final[r] for r in g])):
                outs[rows[g[b]]].append(piece.clone())
    for i, codes in enumerate(utts):
        assert done[i] == codes.shape[1]
        err = rel_err(torch.cat(outs[i]), codec.decode(codes[None])[0])
        assert err <= BOUND, f"utterance {i}: max |d| / peak = {err:.3g}"


def test_reopened_slot_starts_fresh(codec):
    dec = StreamingDecoder(codec, max_slots=2)
    other = dec.open()
    a = dec.open()
    dec.push([a, other], random_codes(15, seed=9)[None].repeat(2, 1, 1), [15, 3], [False, False])
    dec.close(a)  # abandoned mid-utterance: its histories are non-zero
    assert dec.open() == a
    codes = random_codes(13, seed=10)
    outs = dec.push([a], codes[None], [13], [True])
    assert rel_err(outs[0], codec.decode(codes[None])[0]) <= BOUND


def test_the_bound_is_tight_one_corrupted_history(codec):
    """1e-2 added to one layer's history of one slot breaks that stream only."""
    dec = StreamingDecoder(codec, max_slots=3)
    slots = [dec.open() for _ in range(3)]
    codes = torch.stack([random_codes(30, seed=20 + i) for i in range(3)])  # [3, 8, 30]
    outs = [[] for _ in slots]
    for pos in range(0, 30, 6):
        if pos == 12:
            layer = next(i for i, st in enumerate(dec.stages) if st.kind == "res" and st.rate_out == 40)  # block 2
            dec.states[layer][slots[1]] += 1e-2
        for o, got in zip(outs, dec.push(slots, codes[:, :, pos:pos + 6], [6] * 3, [pos + 6 == 30] * 3)):
            o.append(got)
    errs = [rel_err(torch.cat(o), codec.decode(codes[i:i + 1])[0]) for i, o in enumerate(outs)]
    assert errs[0] <= BOUND and errs[2] <= BOUND, errs
    assert errs[1] > 10 * BOUND, errs


# ---------------------------------------------------------------------------- errors
def test_errors(codec):
    dec = StreamingDecoder(codec, max_slots=2)
    a, b = dec.open(), dec.open()
    with pytest.raises(CapacityError):
        dec.open()
    good = torch.zeros(1, 8, 4, dtype=torch.long)
    bad_codes = good.clone()
    bad_codes[0, 3, 2] = 1024
    dec.push([a], bad_codes, [2], [False])  # the bad code lies beyond `valid`: ignored
    for args, match in [(([a], bad_codes, [3], [False]), "0..1023"),
                        (([a], good - 1, [1], [False]), "0..1023"),
                        (([a], good.float(), [1], [False]), "integers"),
                        (([a], good[:, :7], [1], [False]), r"\[1, 8, C\]"),
                        (([a], good, [5], [False]), "valid"),
                        (([a], good, [-1], [False]), "valid"),
                        (([a, a], good.repeat(2, 1, 1), [1, 1], [False, False]), "repeat"),
                        (([a], good, [1, 1], [False]), "length"),
                        (([7], good, [1], [False]), "not open")]:
        with pytest.raises(InvalidInputError, match=match):
            dec.push(*args)
    dec.close(b)
    with pytest.raises(InvalidInputError, match="not open"):
        dec.push([b], good, [1], [False])
    with pytest.raises(InvalidInputError, match="not open"):
        dec.close(b)
    dec.push([a], good, [4], [True])
    with pytest.raises(InvalidInputError, match="after its final"):
        dec.push([a], good, [0], [True])
    with pytest.raises(ConfigError):
        StreamingDecoder(codec, max_slots=0)
    with pytest.raises(ConfigError, match="CUDA"):
        dec.capture([1], [4])
    with pytest.raises(ConfigError, match="max_slots"):
        dec.capture([3], [4], graphs=False)


def test_padding_only_steps_touch_only_the_scratch_slot(codec):
    """What capture's warm-up and replay timing run, and `run_padding_steps` (the codec warm-up's plan-picking pass,
    engine/gpu_memory.py): the arena's `_stage_padding` + `_math` at every bucket shape, eagerly on the CPU. Every
    row is padding, so every open stream's state stays as it was, bit for bit."""
    dec = StreamingDecoder(codec, max_slots=3)
    slots = [dec.open(), dec.open()]
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, codec.geometry.codebook_size, (2, codec.geometry.num_codebooks, 6), generator=gen)
    dec.push(slots, codes, [6, 4], [False, False])
    before = [s[: dec.max_slots].clone() for s in dec.states]
    assert any(bool(b.abs().sum() > 0) for b in before)  # the streams have state to lose
    assert dec.run_padding_steps([2, 3], [1, 4]) == 4  # (2, 3) x (1, 4)
    for b, s in zip(before, dec.states):
        assert torch.equal(b, s[: dec.max_slots])


class ReplayAsEager:
    """A stand-in for a captured graph on the CPU: replay runs the bucket's eager step into its output buffer, times
    `scale` (1.0: a right graph; else the sums of a wrong cuDNN plan)."""

    def __init__(self, dec, key, scale: float):
        self.dec, self.key, self.scale = dec, key, scale

    def replay(self) -> None:
        self.dec._outputs[self.key].copy_(self.dec._math(self.dec._inputs[self.key], self.key) * self.scale)


@pytest.mark.parametrize("scale, wrong", [(1.0, False), (1.2, True)])
def test_check_against_native_compares_each_small_bucket_and_restores_the_arena(codec, scale, wrong):
    """`check_against_native` (the codec warm-up's check of its graphs against PyTorch's native convolutions): each
    bucket of at most `max_row_frames` rows x frames, replayed vs the eager step on `_check_graph`'s random inputs and
    states; a replay whose sums are off shows as their error, a right one within fp32 rounding; the open streams'
    states are as before."""
    dec = StreamingDecoder(codec, max_slots=4)
    dec.capture([1, 2], [1, 2], graphs=False)
    for key in dec._buckets:
        dec._inputs[key] = torch.zeros(dec._input_size(key), dtype=torch.long)
        dec._stage_padding(dec._inputs[key], key)
        dec._outputs[key] = dec._math(dec._inputs[key], key).clone()
        dec._graphs[key] = ReplayAsEager(dec, key, scale if key == (2, 1) else 1.0)
    slot = dec.open()
    dec.push([slot], torch.randint(0, codec.geometry.codebook_size, (1, codec.geometry.num_codebooks, 4)), [4], [False])
    before = [s.clone() for s in dec.states]
    got = dec.check_against_native(max_row_frames=2)  # (1, 1), (1, 2), (2, 1); not (2, 2)
    assert got == pytest.approx(0.2, rel=1e-3) if wrong else got <= 1e-6
    assert all(torch.equal(b, s) for b, s in zip(before, dec.states))
    dec._graphs[(2, 2)].scale = 2.0
    assert dec.check_against_native(max_row_frames=2) == got  # (2, 2) is not checked


@pytest.mark.parametrize("max_rate_out", [1, 40])
def test_the_stages_as_gemms_stream_equal_to_one_shot(codec, max_rate_out):
    """`gemm_stage`: the first conv alone (`gemm_max_rate_out` 1) or with the stages up to 1 kHz too (40, served: the
    first two blocks' transposed conv and residual units) as im2col + GEMMs, on by default on CUDA only; given on a CPU the
    streamed output still equals the one-shot decode, for pushes of 0-12 frames."""
    assert StreamingDecoder(codec, max_slots=1).gemm_stages == 0  # a CPU codec keeps PyTorch's convolutions
    dec = StreamingDecoder(codec, max_slots=1, gemm=True, gemm_max_rate_out=max_rate_out)
    first = 1 if max_rate_out == 1 else 9  # conv1; then at 200 Hz and 1 kHz a transposed conv + 3 residual units each
    assert dec._gemm == [True] * first + [False] * (len(dec.stages) - first)
    assert [st.rate_out for st in dec.stages[:9]] == [1] + [8] * 4 + [40] * 4
    codes = random_codes(23, seed=5)
    got = stream(dec, codes, schedule("random", 23, seed=5))
    assert rel_err(got, codec.decode(codes[None])[0]) <= BOUND
