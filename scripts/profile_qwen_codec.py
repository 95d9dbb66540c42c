"""Where a Qwen3-TTS 12 Hz codec step's GPU time goes: torch.profiler over graph replays of the stateful
decoder (full-size shape, random weights, fp32) at 1 x 1 and 1 x 25 frames: kernels per replay and the
kernel table by device time.

    python scripts/profile_qwen_codec.py [--out prof.txt]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from higgs_stream.bench.measure import kernel_time, report
from higgs_stream.engine.models.qwen3_tts.codec import FULL, QwenCodec
from higgs_stream.engine.models.qwen3_tts.codec.streaming import QwenStreamingDecoder
from higgs_stream.engine.models.qwen3_tts.make_checkpoint import random_decoder

REPLAYS = 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    codec = random_decoder(QwenCodec(FULL), 0).cuda()
    dec = QwenStreamingDecoder(codec, max_slots=4)
    dec.capture((1,), (1, 25))
    slot = dec.open()
    parts = []
    for frames in (1, 25):
        codes = torch.randint(0, codec.cfg.codebook_size, (1, codec.num_codebooks, frames))
        for _ in range(3):
            dec.step([slot], codes, [frames], [False])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                dec.step([slot], codes, [frames], [False])
            torch.cuda.synchronize()
        kernels, device_ms = kernel_time(prof)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
        head = (f"1 x {frames} frames: replay ms {1e3 * dec.timings.get((1, frames), float('nan')):.2f}, "
                f"{kernels / REPLAYS:.0f} device ops per step, {device_ms / REPLAYS:.2f} ms of kernel time per step")
        parts += [head, table]
    report("\n".join(parts), args.out)


if __name__ == "__main__":
    main()
