#!/usr/bin/env bash
# The stateful codec on a GPU, one device call: its GPU tests (the decoder, the codec worker), then the codec benchmark
# with the served decoder (the stages up to 1 kHz as GEMMs) and the all-cuDNN one side by side (higgs_stream.bench_codec).
# Usage (device tool, carry .whl): [GEMM_MAX_RATE_OUT=N] bash scripts/gpu_codec.sh [pytest -k expr]   -> $OUT
# (GEMM_MAX_RATE_OUT: the GEMM decoder's `--gemm-max-rate-out`, default the served 40; 1: the first conv alone)
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/card.txt"
timeout 200 python3 -m pytest -q -x tests/engine/test_codec_streaming_gpu.py tests/stream/test_codec_worker_gpu.py \
  -p no:cacheprovider ${1:+-k "$1"} > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
timeout 300 python3 -m higgs_stream.bench_codec --out "$OUT/bench_codec.json" --batches 1,16,128 --steps 25,5,1 \
  --no-tf32 --stage-times 128:25 ${GEMM_MAX_RATE_OUT:+--gemm-max-rate-out $GEMM_MAX_RATE_OUT} > "$OUT/bench_codec.txt" 2>&1
tail -45 "$OUT/bench_codec.txt" | grep -v '^\[bench_codec'
