#!/usr/bin/env bash
# One device call: install the carried FlashInfer wheels, make the package importable, run the GPU
# tests, then the benchmark. Usage (device tool, carry .whl):  bash scripts/gpu_bench.sh [bench args]
# Writes $OUT/pytest_gpu.log, $OUT/bench.json, $OUT/bench.log.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 420 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels tests/engine/test_model_runner_gpu.py tests/stream/test_codec_graphs.py \
    2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
fi
timeout $(( ${BUDGET_S:-570} - SECONDS )) python3 -m higgs_stream.bench --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -60
