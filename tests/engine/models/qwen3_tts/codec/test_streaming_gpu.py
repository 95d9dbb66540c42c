"""The Qwen3-TTS stateful 12 Hz decoder on CUDA (run through the device tool): its steps replayed from
CUDA graphs equal the eager steps (audio and every slot's state) for random push schedules with streams
joining and leaving the arena, on the tiny fixture codec and a full-size random one; streamed PCM equals
the one-shot decode; a failed capture check falls back to eager steps; capture on a green stream."""

import logging

import pytest
import torch
from higgs_stream.engine.codec import step_graphs
from higgs_stream.engine.codec.step_graphs import CAPTURE_TOLERANCE
from higgs_stream.engine.models.qwen3_tts.codec import FULL, QwenCodec, load_qwen_codec
from higgs_stream.testing import EXACT_REL_TO_PEAK

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> QwenCodec:
    return load_qwen_codec(tiny_dir, device="cuda")


@pytest.fixture(scope="module")
def full() -> QwenCodec:
    """The released tokenizer's decoder shape, random weights conditioned as make_checkpoint's (O(1)
    activations, output inside the clamp); conditioned on the CPU, then moved."""
    from higgs_stream.engine.models.qwen3_tts.make_checkpoint import random_decoder

    return random_decoder(QwenCodec(FULL), 0).cuda()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"{tuple(got.shape)} vs {tuple(want.shape)}"
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def drive(codec: QwenCodec, seed: int, utts: int, max_slots: int, batch_buckets, frame_buckets, max_push: int,
          wide: int, stream: torch.cuda.Stream | None = None) -> None:
    """A graphed and an eager decoder (the same buckets) fed the same random schedule: streams join while
    slots are free, push 0..max_push frames (every 7th step up to `wide`: past every frame bucket, eager in
    both), end with a final push (sometimes of 0 frames) and leave. After every step the audio and the state of
    every slot agree within CAPTURE_TOLERANCE of peak; every utterance equals its one-shot decode."""
    gen = torch.Generator().manual_seed(seed)
    size, q = codec.cfg.codebook_size, codec.num_codebooks
    lengths = torch.randint(1, 4 * max_push, (utts,), generator=gen).tolist()
    codes = [torch.randint(0, size, (q, n), generator=gen) for n in lengths]
    graphed, eager = codec.streaming_decoder(max_slots), codec.streaming_decoder(max_slots)
    check = graphed.capture(batch_buckets, frame_buckets, graphs=True, stream=stream)
    assert graphed.graphed and check <= CAPTURE_TOLERANCE, f"capture check {check:.3g}"
    assert set(graphed.timings) == {(b, c) for b in batch_buckets for c in frame_buckets}
    assert eager.capture(batch_buckets, frame_buckets, graphs=False) == 0.0 and not eager.graphed
    waiting, active = list(range(utts)), {}  # utterance -> slot
    pos, out = [0] * utts, [[] for _ in range(utts)]
    replays_before, graph_steps, step = graphed.replays, 0, 0
    while waiting or active:
        while waiting and graphed.free_slots and (not active or torch.rand((), generator=gen) < 0.5):
            u = waiting.pop(0)
            slot = graphed.open()
            assert eager.open() == slot, "both decoders hand out the same slots"
            active[u] = slot
        rows = list(active)
        width = wide if step % 7 == 3 else max_push
        valid, final = [], []
        batch = torch.randint(0, size, (len(rows), q, width), generator=gen)  # junk beyond valid
        for r, u in enumerate(rows):
            v = min(int(torch.randint(0, width + 1, (), generator=gen)), lengths[u] - pos[u])
            batch[r, :, :v] = codes[u][:, pos[u]:pos[u] + v]
            pos[u] += v
            valid.append(v)
            final.append(pos[u] == lengths[u] and (v == 0 or torch.rand((), generator=gen) < 0.7))
        graph_steps += 0 < max(valid) <= max(frame_buckets) and len(rows) <= max(batch_buckets)
        slots = [active[u] for u in rows]
        got = [p.clone() for p in graphed.push(slots, batch, valid, final)]  # views of a graph's buffer
        want = eager.push(slots, batch, valid, final)
        for r, u in enumerate(rows):
            assert got[r].numel() == valid[r] * codec.hop
            err = rel(got[r], want[r])
            assert err <= CAPTURE_TOLERANCE, f"step {step}, utterance {u}: graphed vs eager audio {err:.3g} of peak"
            out[u].append(got[r])
        for i, (g, e) in enumerate(zip(graphed.states, eager.states)):  # every slot (not the scratch one)
            err = rel(g[:max_slots], e[:max_slots])
            assert err <= CAPTURE_TOLERANCE, f"step {step}: arena state {i} graphed vs eager {err:.3g} of peak"
        for u, f in zip(rows, final):
            if f:
                graphed.close(active[u])
                eager.close(active.pop(u))
        step += 1
        assert step < 50 * utts, "schedule did not finish"
    assert graphed.replays - replays_before == graph_steps > 0 and eager.replays == 0
    assert graphed.free_slots == max_slots
    for u in range(utts):
        want = codec.decode(codes[u][None])[0]
        err = rel(torch.cat(out[u]), want)
        assert err <= EXACT_REL_TO_PEAK, f"utterance {u} ({lengths[u]} frames): streamed vs one-shot {err:.3g}"


@pytest.mark.parametrize("seed", range(3))
def test_tiny_graph_replay_equals_the_eager_step(tiny, seed):
    drive(tiny, seed, utts=12, max_slots=5, batch_buckets=[2, 5], frame_buckets=[1, 2, 4, 8], max_push=8, wide=11)


def test_full_size_graph_replay_equals_the_eager_step(full):
    drive(full, 0, utts=10, max_slots=6, batch_buckets=[2, 6], frame_buckets=[1, 4, 8], max_push=8, wide=12)


def test_capture_keeps_the_arena_and_prices_steps_by_replay(tiny):
    """A stream half-decoded before capture carries on exactly (the capture check restores every slot)."""
    codes = torch.randint(0, tiny.cfg.codebook_size, (1, 16, 30), generator=torch.Generator().manual_seed(3))
    dec = tiny.streaming_decoder(4)
    slot = dec.open()
    head = dec.push([slot], codes[:, :, :7], [7], [False])[0].clone()  # eager: no buckets yet
    assert dec.capture([1, 4], [4, 8]) <= CAPTURE_TOLERANCE and dec.graphed
    assert all(0 < t < 1.0 for t in dec.timings.values())
    assert dec.step_cost(3, 5) == dec.timings[(4, 8)] and dec.step_cost(1, 2) == dec.timings[(1, 4)]
    parts = [head]
    for a in range(7, 30, 8):
        b = min(a + 8, 30)
        parts.append(dec.push([slot], codes[:, :, a:b], [b - a], [b == 30])[0].clone())
    assert dec.replays == 3
    assert rel(torch.cat(parts), tiny.decode(codes)[0]) <= EXACT_REL_TO_PEAK


def test_a_failed_capture_check_decodes_eagerly(tiny, monkeypatch, caplog):
    monkeypatch.setattr(step_graphs, "CAPTURE_TOLERANCE", -1.0)  # any check fails
    dec = tiny.streaming_decoder(2)
    with caplog.at_level(logging.ERROR):
        check = dec.capture([2], [4])
    assert check >= 0.0 and not dec.graphed and dec.timings == {}
    assert "Qwen3-TTS codec streaming graphs differ from the eager step" in caplog.text
    codes = torch.randint(0, tiny.cfg.codebook_size, (1, 16, 6), generator=torch.Generator().manual_seed(4))
    slot = dec.open()
    pcm = dec.push([slot], codes, [6], [True])[0]
    assert dec.replays == 0 and rel(pcm, tiny.decode(codes)[0]) <= EXACT_REL_TO_PEAK


def test_graphs_captured_on_a_green_stream(tiny):
    from higgs_stream.engine.green_context import green_stream

    green = green_stream(torch.device("cuda"), 16)
    with torch.cuda.stream(green):
        drive(tiny, 7, utts=6, max_slots=4, batch_buckets=[4], frame_buckets=[2, 8], max_push=8, wide=8,
              stream=green)
    torch.cuda.synchronize()
