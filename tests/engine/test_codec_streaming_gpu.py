"""Incremental Code2Wav on CUDA, full-size codec (random weights): graph replay == eager == one-shot decode, with the
first conv as one GEMM (the default) and on cuDNN (run through the device tool)."""

import pytest
import torch
from higgs_stream.engine.codec import StreamingDecoder
from higgs_stream.engine.codec.streaming import CAPTURE_TOLERANCE

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BOUND = 1e-5  # max |d| / peak


@pytest.fixture(scope="module")
def codec():
    from higgs_stream.engine.random_weights import random_full_codec

    return random_full_codec(seed=0)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"{tuple(got.shape)} vs {tuple(want.shape)}"
    return float((got - want).abs().max() / want.abs().max())


def test_graphed_equals_eager_equals_one_shot_at_batch_16(codec):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(12, 48, (16,), generator=gen).tolist()
    utts = [torch.randint(0, 1024, (8, f), generator=gen) for f in lengths]
    graphed, eager = StreamingDecoder(codec, max_slots=16), StreamingDecoder(codec, max_slots=16)
    plain = StreamingDecoder(codec, max_slots=16, gemm=False)
    assert graphed.gemm_stages == eager.gemm_stages == 1 and plain.gemm_stages == 0  # the first conv
    check = graphed.capture([4, 16], [8, 18])
    assert graphed.graphed and check <= CAPTURE_TOLERANCE, f"capture check {check:.3g}"
    # every bucket's replay was timed: partition() prices steps with these
    assert set(graphed.timings) == {(b, c) for b in (4, 16) for c in (8, 18)}
    assert all(0 < t < 1.0 for t in graphed.timings.values())
    assert graphed.step_cost(16, 18) == graphed.timings[(16, 18)] and graphed.step_cost(3, 5) == graphed.timings[(4, 8)]
    # the graphs vs the same steps on PyTorch's native convolutions everywhere (the served warm-up's check)
    assert graphed.check_against_native() <= BOUND
    decs = {"graphed": graphed, "eager": eager, "plain": plain}
    slots = {k: [d.open() for _ in utts] for k, d in decs.items()}
    out = {k: [[] for _ in utts] for k in slots}
    pos = [0] * len(utts)
    step = 0
    while any(p < f for p, f in zip(pos, lengths)):
        width = 30 if step == 3 else 8  # step 3 is wider than every bucket: eager in both decoders
        rows = [i for i, (p, f) in enumerate(zip(pos, lengths)) if p < f]
        codes = torch.full((len(rows), 8, width), 4096, dtype=torch.long)  # junk beyond valid
        valid, final = [], []
        for r, i in enumerate(rows):
            v = min(int(torch.randint(0, width + 1, (), generator=gen)), lengths[i] - pos[i])
            codes[r, :, :v] = utts[i][:, pos[i]:pos[i] + v]
            pos[i] += v
            valid.append(v)
            final.append(pos[i] == lengths[i])
        for kind, dec in decs.items():
            got = dec.push([slots[kind][i] for i in rows], codes, valid, final)
            for r, i in enumerate(rows):
                out[kind][i].append(got[r].clone())  # views of the graph's buffer: copy before the next push
        step += 1
    assert graphed.replays > 0 and eager.replays == plain.replays == 0
    for i, codes in enumerate(utts):
        want = codec.decode(codes[None])[0]
        g, e, p = (torch.cat(out[k][i]) for k in ("graphed", "eager", "plain"))
        errs = rel_err(g, want), rel_err(e, want), rel_err(p, want), rel_err(g, e)
        assert max(errs) <= BOUND, f"utterance {i} ({lengths[i]} frames): graphed/eager/plain/g-e vs one-shot {errs}"


def test_step_output_converts_to_s16_in_one_op(codec):
    dec = StreamingDecoder(codec, max_slots=4)
    dec.capture([4], [35])
    slots = [dec.open() for _ in range(3)]
    codes = torch.randint(0, 1024, (3, 8, 25), generator=torch.Generator().manual_seed(1))
    step = dec.step(slots, codes, [25, 20, 5], [True, True, True])
    pcm = (step.audio.clamp(-1, 1) * 32767).round().to(torch.int16).cpu()  # every row, one copy
    for r in range(3):
        want = codec.decode(codes[r:r + 1, :, :[25, 20, 5][r]])[0]
        got = pcm[r, step.offsets[r]:step.offsets[r] + step.counts[r]]
        ref = (want.clamp(-1, 1) * 32767).round().to(torch.int16).cpu()
        assert got.shape == ref.shape
        assert int((got.int() - ref.int()).abs().max()) <= 1  # one LSB where rounding straddles .5
