"""REF's audio state machine driven by hand-made samples: AUDIO_INIT, ramp-in/out, RAS, cap, stop.

Columns are written out by hand where they are short enough to check by eye. `B`/`E` are the
stream BOS/EOS ids (1024/1025). The last tests pin where the transformers port and Boson's vLLM
fork disagree with REF.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.higgs_audio_v2.generation_higgs_audio_v2 import HiggsAudioV2DelayPatternLogitsProcessor

from higgs_stream.engine.models.delay_pattern import STREAM_BOS as B
from higgs_stream.engine.models.delay_pattern import STREAM_EOS as E
from higgs_stream.engine.models.delay_pattern import (
    columns_to_frames,
    count_stray,
    delayed_prompt_audio,
    revert_delay_pattern,
)
from higgs_stream.engine.models.higgs_v2.policy import SegmentState
from higgs_stream.engine.request import SamplingParams
from higgs_stream.engine.sampling import SamplingTensors, sample_columns

NO_RAS = {"ras_window": 0}


def run(seg: SegmentState, samples: list[list[int]], candidates: list[list[int]] | None = None) -> np.ndarray:
    """start() then advance() with each sample until the segment finishes; [8, L] columns."""
    seg.start()
    for i, s in enumerate(samples):
        if seg.finished:
            break
        seg.advance(s, candidates[i] if candidates else [0] * 8)
    return seg.as_array()


def plain(j: int) -> list[int]:
    """A sample without stream ids: codebook k gets 100*k + j (mod 1000)."""
    return [(100 * k + j) % 1000 for k in range(8)]


def test_audio_init_and_ramp_in():
    seg = SegmentState(max_frames=100, **NO_RAS)
    cols = run(seg, [plain(j) for j in range(1, 10)])
    assert cols.shape == (8, 10) and not seg.finished
    assert (cols[:, 0] == B).all()  # AUDIO_INIT: forced all-BOS column
    for j in range(1, 8):  # column j: codebooks >= j are BOS, the others the sample
        assert cols[:j, j].tolist() == plain(j)[:j]
        assert (cols[j:, j] == B).all()
    assert cols[:, 8].tolist() == plain(8) and cols[:, 9].tolist() == plain(9)  # free from column 8


def test_ramp_out_from_codebook_0_gives_frames_equal_columns_minus_9():
    samples = [plain(j) for j in range(1, 30)]
    samples[10 - 1][0] = E  # codebook 0 samples EOS at column E = 10
    seg = SegmentState(max_frames=100, **NO_RAS)
    cols = run(seg, samples)
    assert seg.finished and seg.reason == "stop"
    assert cols.shape[1] == 18  # L = E + 8: columns 10..17 are the ramp-out
    for m in range(8):  # column E + m: codebooks < max(m, 1) are EOS, the rest sampled
        c = cols[:, 10 + m]
        n_eos = max(m, 1)
        assert (c[:n_eos] == E).all() and c[n_eos:].tolist() == plain(10 + m)[n_eos:], m
    frames = columns_to_frames(cols)
    assert frames.shape[1] == cols.shape[1] - 9 == 9 == seg.num_frames
    assert count_stray(revert_delay_pattern(cols)[:, 1:-1]) == 0  # every kept frame is model output


def test_lowest_index_eos_quirk():
    """EOS sampled at codebooks 2 and 5: REF takes idx = 2 (the lowest), not 5."""
    samples = [plain(j) for j in range(1, 30)]
    samples[12 - 1][2] = E
    samples[12 - 1][5] = E
    seg = SegmentState(max_frames=100, **NO_RAS)
    cols = run(seg, samples)
    assert cols[:, 12].tolist() == [E, E, E] + plain(12)[3:5] + [E] + plain(12)[6:]
    assert seg.finished and cols.shape[1] == 12 + 8 - 2  # K - idx - 1 = 5 more columns
    for m in range(1, 6):
        assert (cols[: 2 + m, 12 + m] == E).all() and cols[2 + m :, 12 + m].tolist() == plain(12 + m)[2 + m :]
    # Boson's vLLM fork uses the HIGHEST index (5): the stream would end 3 columns earlier.
    vllm_len = 12 + 8 - 5
    assert cols.shape[1] != vllm_len
    assert columns_to_frames(cols).shape[1] == cols.shape[1] - 9


def test_later_eos_samples_do_not_restart_the_countdown():
    samples = [plain(j) for j in range(1, 40)]
    samples[9][0] = E  # column 10
    for j in range(11, 18):
        samples[j - 1] = [E] * 8 if j % 2 else [E, 1, 2, E, 4, 5, E, 7]
    seg = SegmentState(max_frames=100, **NO_RAS)
    assert run(seg, samples).shape[1] == 18


def test_eos_during_ramp_in():
    samples = [plain(j) for j in range(1, 30)]
    samples[3 - 1][0] = E  # column 3, while codebooks 3.. are still BOS
    seg = SegmentState(max_frames=100, **NO_RAS)
    cols = run(seg, samples)
    assert cols.shape[1] == 11 and seg.reason == "stop"
    assert cols[:, 3].tolist() == [E] + plain(3)[1:3] + [B] * 5
    assert cols[:, 5].tolist() == [E, E] + plain(5)[2:5] + [B] * 3  # countdown and ramp-in overlap
    frames = columns_to_frames(cols)
    assert frames.shape[1] == 2 and count_stray(revert_delay_pattern(cols)[:, 1:-1]) == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_endings_decode_to_columns_minus_9_frames(seed):
    """Any EOS timing and index: L - 9 frames. One sampled EOS leaves every kept frame clean; more
    EOS in the first EOS column (above the lowest) land inside kept frames as strays, which
    columns_to_frames replaces."""
    rng = np.random.default_rng(seed)
    samples = [rng.integers(0, 1024, 8).tolist() for _ in range(60)]
    at = int(rng.integers(1, 40))
    free = min(at, 8)  # codebooks not forced to BOS by the ramp-in at column `at`
    lowest = int(rng.integers(0, free))
    samples[at - 1][lowest] = E
    seg = SegmentState(max_frames=100, **NO_RAS)
    cols = run(seg, samples)
    assert seg.finished and cols.shape[1] == at + 8 - lowest
    frames = revert_delay_pattern(cols)[:, 1:-1]
    assert frames.shape[1] == cols.shape[1] - 9 == seg.num_frames
    assert count_stray(frames) == 0
    # a second EOS above the lowest one, in the same column
    if lowest + 1 < free:
        samples[at - 1][free - 1] = E
        seg2 = SegmentState(max_frames=100, **NO_RAS)
        cols2 = run(seg2, samples)
        assert cols2.shape == cols.shape
        assert count_stray(revert_delay_pattern(cols2)[:, 1:-1]) == 1  # frame at - (free - 1) is kept
        assert columns_to_frames(cols2).max() < 1024


def test_frame_cap_forces_a_clean_ramp_out():
    seg = SegmentState(max_frames=5, **NO_RAS)
    cols = run(seg, [plain(j) for j in range(1, 40)])
    assert seg.finished and seg.reason == "length"
    assert cols.shape[1] == 5 + 9 and seg.num_frames == 5
    assert cols[0, 6] == E and cols[1:, 6].tolist() == [plain(6)[1], plain(6)[2], plain(6)[3], plain(6)[4],
                                                         plain(6)[5], B, B]
    assert count_stray(revert_delay_pattern(cols)[:, 1:-1]) == 0
    # a ramp-out already under way is left alone: the model's own stop, fewer frames
    samples = [plain(j) for j in range(1, 40)]
    samples[3][4] = E  # column 4: ramp-in leaves codebooks 0..3 free, this EOS is overwritten by BOS
    samples[4][1] = E  # column 5, idx 1: the model's own stop before the cap column 6
    seg2 = SegmentState(max_frames=5, **NO_RAS)
    cols2 = run(seg2, samples)
    assert seg2.reason == "stop" and cols2.shape[1] == 5 + 8 - 1 and seg2.num_frames == 3


def test_ras_counts_bos_eos_and_prompt_audio():
    """REF's window holds the last 7 audio-out columns in context, stream ids included."""
    prompt_audio = delayed_prompt_audio(np.full((8, 4), 77))  # its last 7 columns end the EOS ramp
    seg = SegmentState(max_frames=100, ras_window=7, ras_max_repeat=2, context_audio=prompt_audio)
    seg.start()
    window = list(seg.window)
    assert len(window) == 7 and window[-1] == (B,) * 8 and window[0] == tuple(prompt_audio[:, -6])
    cand = [500 + k for k in range(8)]
    # codebook 0 samples EOS: the window has 6 EOS in codebook 0 -> resampled (REF);
    # codebook 7 samples 77: prompt columns -6.. hold 77 in codebook 7 twice -> resampled;
    # codebook 1 samples 5: no repeat -> kept.
    col = seg.advance([E, 5, 9, 9, 9, 9, 9, 77], cand)
    assert col == (500,) + (B,) * 7  # column 1: codebooks >= 1 are ramp-in BOS anyway
    assert seg.num_ras_resampled == 2  # codebooks 0 and 7
    assert not seg.finished and seg.num_remaining is None  # so no ramp-out starts at column 1
    # The transformers port masks BOS/EOS out of the count (inline in its `_sample`, not callable
    # alone): with its rule codebook 0 would have 0 repeats, keep the EOS and end the segment here.
    assert sum(1 for c in window if c[0] == E) == 6


def test_ras_candidate_is_not_rechecked_and_window_zero_disables():
    seg = SegmentState(max_frames=100, ras_window=7, ras_max_repeat=2)
    run(seg, [[3] * 8 for _ in range(9)], [[3] * 8 for _ in range(9)])
    before = seg.num_ras_resampled
    col = seg.advance([3] * 8, [3] * 8)  # candidate equal to the repeated id is used as is
    assert col == (3,) * 8 and seg.num_ras_resampled == before + 8
    off = SegmentState(max_frames=100, ras_window=0)
    run(off, [[3] * 8 for _ in range(20)], [[9] * 8 for _ in range(20)])
    assert off.num_ras_resampled == 0 and off.as_array()[:, 8:].max() == 3


def test_ras_applies_in_greedy_mode():
    """Greedy picks the same argmax every step; RAS then swaps repeats for draws from the raw logits."""
    logits = torch.full((1, 8, 1026), -5.0)
    logits[0, :, 42] = 2.0  # argmax 42; raw softmax gives it only 52%, the rest spread over 1025 ids
    p = SamplingParams(temperature=0.0)
    st = SamplingTensors.build([p], 1026, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    seg = SegmentState(max_frames=100, ras_window=p.ras_window, ras_max_repeat=p.ras_max_repeat)
    seg.start()
    for _ in range(30):
        d = sample_columns(logits, st, [gen])[0]
        assert (d[0] == 42).all()  # the greedy choice
        seg.advance(d[0].tolist(), d[1].tolist())
    cols = seg.as_array()[:, 9:]
    assert (cols == 42).mean() < 0.5  # without RAS every column would be all 42
    assert seg.num_ras_resampled > 0


# ------------------------------------------------------------------------- transformers port
def hf_columns(raw: list[torch.Tensor], prompt_len: int = 10) -> list[list[int]]:
    """Drive HF's delay-pattern logits processor the way its `_sample` does (argmax, no RAS).

    Its text bookkeeping: after a column with any EOS (or after a delay token) the next text token
    is the audio delay token; generation stops at an all-EOS column.
    """
    aob, audio_tok, delay_tok = 7, 8, 9
    proc = HiggsAudioV2DelayPatternLogitsProcessor(
        delay_pattern=[k + 1 for k in range(8)], audio_bos_token_id=aob, audio_eos_token_id=delay_tok,
        audio_stream_bos_id=B, audio_stream_eos_id=E, num_codebooks=8, codebook_size=1026)
    input_ids = torch.tensor([[1] * (prompt_len - 1) + [aob]])
    cols = []
    for logits in raw:
        tok = proc(input_ids, logits.reshape(1, -1)).argmax(-1)  # [8]
        cols.append(tok.tolist())
        if (tok == E).all():
            break
        nxt = delay_tok if (tok == E).any() or input_ids[0, -1] == delay_tok else audio_tok
        input_ids = torch.cat([input_ids, torch.tensor([[nxt]])], dim=1)
    return cols


def fake_logits(samples: list[list[int]]) -> list[torch.Tensor]:
    out = []
    for s in samples:
        logits = torch.zeros(8, 1026)
        logits[torch.arange(8), torch.tensor(s)] = 10.0
        out.append(logits)
    return out


def test_transformers_port_ramp_in_same_ramp_out_one_column_longer():
    samples = [plain(j) for j in range(40)]  # samples[j] is what the model prefers at column j
    samples[10][0] = E
    hf = hf_columns(fake_logits(samples))
    seg = SegmentState(max_frames=100, **NO_RAS)
    ours = run(seg, samples[1:])
    assert ours.shape[1] == 18
    assert np.array_equal(np.array(hf[:18]).T, ours)  # identical up to our last column
    assert len(hf) == 19 and hf[18] == [E] * 8  # HF appends an all-EOS column as its stop marker


def test_transformers_port_ignores_the_eos_index():
    """EOS first at codebook 3: REF forces codebooks 0..2 to EOS at once; HF forces codebook 0 a step later."""
    samples = [plain(j) for j in range(40)]
    samples[12][3] = E
    hf = hf_columns(fake_logits(samples))
    seg = SegmentState(max_frames=100, **NO_RAS)
    ours = run(seg, samples[1:])
    assert ours[:, 12].tolist()[:4] == [E, E, E, E]
    assert hf[12][:4] == plain(12)[:3] + [E]
    assert ours.shape[1] == 12 + 8 - 3 and len(hf) == 12 + 9
