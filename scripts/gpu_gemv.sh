#!/usr/bin/env bash
# One device call (~8 min, one H100): the GPU tests of the model runner, quantized linears, paged decode, draw,
# activation and norm kernels; the CUDA-core GEMV's sweep (scripts/sweep_gemv.py); then the fp8 + e4m3-pages step
# at 1/16/64/256 rows three ways in separate processes: the tensor-core kernel at 1-4 rows (served), the CUDA-core
# GEMV at 1-4 rows with the sweep's best blocks, and the latter with --fuse-fp8-quant.
# Usage (device tool, carry .whl): bash scripts/gpu_gemv.sh  -> $OUT/{gpu.txt,gpu_tests.log,gemv_sweep.json,step_*.json,step.log}
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
budget=${BUDGET_S:-570}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout "${TESTS_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_model_runner_gpu.py \
  tests/engine/test_quantize_gpu.py tests/kernels/test_paged_decode_gpu.py tests/kernels/test_sample_rows_gpu.py \
  tests/kernels/test_activation_gpu.py tests/kernels/test_fused_norm_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
timeout 150 python3 scripts/sweep_gemv.py --out "$OUT" --weights fp8 --batches 1,4,16 2>&1 | grep -E "layer|done|Error" | cut -c1-240
blocks=$(python3 -c "import json; print(json.load(open('$OUT/gemv_sweep.json'))['summary']['fp8 m=1']['best_gemv_blocks'])" 2>/dev/null)
echo "GEMV blocks for the step: ${blocks:-default}"
run() {  # run NAME ARGS...: one bench_quant process
  local name=$1; shift
  local left=$(( (budget - SECONDS - 10) / ${RUNS_LEFT} )); RUNS_LEFT=$(( RUNS_LEFT - 1 ))
  timeout "$left" python3 -m higgs_stream.bench_quant --sections model --modes fp8/kv8 --streams "" --greedy-steps 16 \
    --batches 1,16,64,256 --budget-s $(( left - 10 )) --out "$OUT/step_$name.json" "$@" 2>&1 | tee -a "$OUT/step.log" \
    | grep -E "decode b=|replay|Error|error" | sed "s/^/$name: /" | cut -c1-200
}
RUNS_LEFT=3
run tc
run gemv --cuda-core-gemv-rows 4 ${blocks:+--gemv-blocks $blocks}
run gemv_fuse --cuda-core-gemv-rows 4 ${blocks:+--gemv-blocks $blocks} --fuse-fp8-quant
echo "done in $SECONDS s"
