"""The codec benchmark's one-shot ceiling and its table (higgs_stream/bench_codec.py), on the CPU with a stand-in
codec: under a memory bound the whole utterances go through in the largest sub-batch that fits, each decoded once;
a row that could not run prints its error instead of breaking the table."""

from __future__ import annotations

import torch

from higgs_stream import bench_codec as bc


class BoundedCodec:
    """Decodes [B, 8, T] codes into [B, 1, T * 960] zeros; more than `fits` utterances at once: out of memory."""

    def __init__(self, fits: int) -> None:
        self.fits, self.calls = fits, []

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.shape[0] > self.fits:
            raise torch.cuda.OutOfMemoryError("stand-in")
        self.calls.append(codes.shape[0])
        return torch.zeros(codes.shape[0], 1, codes.shape[2] * 960)


def test_one_shot_halves_its_sub_batch_until_the_utterances_fit():
    codec = BoundedCodec(fits=40)
    row = bc.one_shot(codec, 128, torch.device("cpu"))
    assert row["sub_batch"] == 32 and row["batch"] == 128 and row["frames_per_call"] == bc.UTTERANCE
    assert codec.calls == [32] * 4 * 4  # warm-up + 3 timed calls, each the 128 utterances once in 4 sub-batches
    assert row["frames_per_s"] > 0 and "error" not in row


def test_one_shot_whole_batch_when_it_fits_and_an_error_when_nothing_does():
    assert bc.one_shot(BoundedCodec(fits=16), 16, torch.device("cpu"))["sub_batch"] == 16
    row = bc.one_shot(BoundedCodec(fits=0), 4, torch.device("cpu"))
    assert row == {"kind": "one_shot", "batch": 4, "frames_per_call": bc.UTTERANCE, "error": "out of memory"}


def test_the_table_prints_an_error_row(capsys):
    rows = [{"kind": "one_shot", "batch": 1, "frames_per_call": 250, "frames_per_s": 31551.9},
            {"kind": "one_shot", "batch": 128, "frames_per_call": 250, "error": "out of memory"}]
    bc.summarize({"card": "stand-in", "preset": "full", "state_bytes_per_stream": 1, "batches": [1, 16, 128],
                  "rows": rows, "parity": {"graphed_max_rel_err": 1.3e-6}})
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("one_shot"))
    assert line.split()[2:] == ["31552", "—", "out", "of", "memory"]


def test_stage_times_counts_every_stage_once_and_restores_the_decoder():
    """`stage_times` on the tiny codec (CPU): a row per decoder stage in order, FLOPs as counted from the layer plan
    (C frames feed C x rate_in new inputs to a stage: a conv's and a residual unit's outputs, a transposed conv's
    inputs plus its one-sample history), the rest of the step non-negative, and the decoder's `_advance_stage` put
    back (the class's method again)."""
    import math

    from higgs_stream.engine.codec import CodecConfig, StreamingDecoder, codec_from_state_dict
    from higgs_stream.engine.codec.make import build_reference_model

    cfg = CodecConfig.tiny()
    codec = codec_from_state_dict(build_reference_model(cfg, seed=3).state_dict(), cfg, with_encoder=False)
    dec = StreamingDecoder(codec, 4)
    b, c = 2, 5
    st = bc.stage_times(dec, b, c, torch.device("cpu"), iters=2)
    assert "_advance_stage" not in vars(dec) and dec.free_slots == 4
    assert [r["stage"] for r in st["stages"]] == list(range(len(dec.stages)))
    want = 0.0
    for stage, row in zip(dec.stages, st["stages"]):
        n, m = c * stage.rate_in, stage.module
        if stage.kind == "conv":
            want_stage = 2 * b * n * math.prod(m.weight.shape)
        elif stage.kind == "conv_t":
            want_stage = 2 * b * (n + 1) * math.prod(m.weight.shape)
        else:
            want_stage = 2 * b * n * (math.prod(m.conv1.weight.shape) + math.prod(m.conv2.weight.shape))
        assert row["kind"] == stage.kind and abs(row["gflop"] * 1e9 - want_stage) <= 1e-6 * want_stage
        assert row["ms"] > 0 and row["rate_hz"] == stage.rate_out * 25
        want += want_stage
    assert abs(st["gflop"] * 1e9 - want) <= 1e-6 * want
    assert st["step_ms"] >= st["stages_ms"] > 0 and abs(st["rest_ms"] - (st["step_ms"] - st["stages_ms"])) < 1e-9
