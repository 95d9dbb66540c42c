#!/usr/bin/env bash
# The fused codec layers on a GPU, one device call: their GPU tests, the per-stage sweep (scripts/sweep_codec_layers.py)
# and the codec benchmark with the fused and the plain decoder side by side (higgs_stream.bench_codec).
# Usage (device tool, carry .whl): bash scripts/gpu_codec_layers.sh [pytest -k expr]   -> $OUT
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/card.txt"
timeout 300 python3 -m pytest -q -x tests/kernels/test_codec_layers_gpu.py tests/engine/test_codec_streaming_gpu.py \
  tests/stream/test_codec_worker_gpu.py -p no:cacheprovider ${1:+-k "$1"} 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 200 python3 scripts/sweep_codec_layers.py --out "$OUT/sweep.json" 2>&1 | tail -20 | tee "$OUT/sweep.txt"
timeout 400 python3 -m higgs_stream.bench_codec --out "$OUT/bench_codec.json" --batches 1,16,128 --steps 25,5,1 \
  --no-tf32 --stage-times 128:25 2>&1 | tail -60 | tee "$OUT/bench_codec.txt"
