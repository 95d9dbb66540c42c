#!/usr/bin/env bash
# One device call: install the carried FlashInfer wheels, make the package importable, run the GPU
# tests, then the benchmark. Usage (device tool, carry .whl):  bash scripts/gpu_bench.sh [bench args]
# Writes $OUT/pytest_gpu.log, $OUT/bench.json, $OUT/bench.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
  # shim: a higgs_stream package whose sub-packages are the top-level folders
  mkdir -p /tmp/shim/higgs_stream
  for d in engine kernels stream clients; do ln -sfn "$PWD/$d" /tmp/shim/higgs_stream/$d; done
  for f in higgs_stream/*.py; do ln -sf "$PWD/$f" /tmp/shim/higgs_stream/; done
  export PYTHONPATH=/tmp/shim:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 420 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/kernels tests/engine/test_gpu_engine_gpu.py tests/stream/test_codec_graphs.py \
    2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
fi
timeout $(( ${BUDGET_S:-570} - SECONDS )) python3 -m higgs_stream.bench --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -60
