"""The Qwen3-TTS 12 Hz codec's streaming decoder on the GPU (full-size shape, random conditioned
weights): graph replay time per (streams, frames) bucket in three precision settings, beside the
one-shot decode of whole utterances (the ceiling), and each setting's error vs the exact one-shot.

    python scripts/bench_qwen_codec.py --out qwen_codec.json

Settings: exact (fp32, no TF32, cuDNN's default algorithms: the server's default), exact+autotune
(the same math with cudnn.benchmark picking algorithms), tf32 (`--codec-precision tf32`)."""

from __future__ import annotations

import argparse
import json

import torch
from higgs_stream.engine.models.qwen3_tts.codec import FULL, QwenCodec
from higgs_stream.engine.models.qwen3_tts.codec.streaming import QwenStreamingDecoder
from higgs_stream.bench.measure import timed
from higgs_stream.engine.models.qwen3_tts.make_checkpoint import random_decoder

BATCHES, FRAMES = (1, 16, 64), (1, 2, 25)
ONE_SHOT = ((1, 250), (16, 250), (64, 100))


def full_codec() -> QwenCodec:
    return random_decoder(QwenCodec(FULL), 0).cuda()


def one_shot_ms(codec: QwenCodec, b: int, f: int) -> float:
    """Mean ms of a one-shot decode of b utterances of f frames (3 back-to-back calls after one)."""
    codes = torch.randint(0, codec.cfg.codebook_size, (b, codec.num_codebooks, f), device="cuda")
    return 1e3 * timed(lambda: codec.decode(codes), 3, codes.device, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    codec = full_codec()
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, codec.cfg.codebook_size, (2, codec.num_codebooks, 100), generator=gen)
    exact = codec.decode(probe)
    peak = float(exact.abs().max())
    result = {"gpu": torch.cuda.get_device_name(), "settings": {}}
    for name, tf32, autotune in (("exact", False, False), ("exact+autotune", False, True), ("tf32", True, False)):
        codec.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = autotune
        err = float((codec.decode(probe) - exact).abs().max()) / peak
        dec = QwenStreamingDecoder(codec, max_slots=max(BATCHES))
        dec.capture(BATCHES, FRAMES)
        steps = [{"streams": b, "frames": c, "replay_ms": 1e3 * s, "frames_per_s": b * c / s}
                 for (b, c), s in sorted(dec.timings.items())]
        shots = [{"streams": b, "frames": f, "ms": ms, "frames_per_s": b * f / (ms / 1e3)}
                 for b, f in ONE_SHOT for ms in [one_shot_ms(codec, b, f)]]
        result["settings"][name] = {"max_err_rel_peak": err, "steps": steps, "one_shot": shots}
        print(f"{name}: max |d| vs exact one-shot {err:.2e} of peak")
        for r in steps:
            print(f"  step {r['streams']:>3} x {r['frames']:>2}: {r['replay_ms']:7.2f} ms  {r['frames_per_s']:8.0f} frames/s")
        for r in shots:
            print(f"  one-shot {r['streams']:>3} x {r['frames']}: {r['ms']:7.2f} ms  {r['frames_per_s']:8.0f} frames/s")
        del dec
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
