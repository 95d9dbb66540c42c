#!/usr/bin/env bash
# One device call (~6-9 min, one H100): the GPU tests of the model runner, quantized linears, paged decode, draw,
# activation and norm kernels; the CUDA-core GEMV's sweep (scripts/sweep_gemv.py); then the fp8 + e4m3-pages step
# under several bench_quant flag sets, each in its own process (`@BLOCKS` in a flag set: --gemv-blocks with the
# sweep's best for one row).
# Usage (device tool, carry .whl): bash scripts/gpu_gemv.sh  -> $OUT/{gpu.txt,gpu_tests.log,gemv_sweep.json,step_*.json,step.log}
# A flag set may name other modes (--modes none: bf16), the later flag wins.
# Env (defaults): SKIP_TESTS=1 (no tests), TESTS (pytest paths; default the list below), TESTS_S=200, SWEEP="--batches 1,4,16" (scripts/sweep_gemv.py's arguments; "none": no
#   sweep), SWEEP_S=150, BATCHES=1,16,64,256, RUNS="tc=;gemv=--cuda-core-gemv-rows 4 @BLOCKS;gemv_fuse=...", BUDGET_S=570.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
budget=${BUDGET_S:-570}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TESTS_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests/engine/test_model_runner_gpu.py \
    tests/engine/test_quantize_gpu.py tests/kernels/test_paged_decode_gpu.py tests/kernels/test_sample_rows_gpu.py \
    tests/kernels/test_activation_gpu.py tests/kernels/test_fused_norm_gpu.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
fi
sweep=${SWEEP:---batches 1,4,16}
if [ "$sweep" != none ]; then
  timeout "${SWEEP_S:-150}" python3 scripts/sweep_gemv.py --out "$OUT" --weights fp8 $sweep 2>&1 | tee "$OUT/sweep.log" \
    | grep -E "layer|done|Error" | cut -c1-240
fi
blocks=$(python3 -c "import json; print(json.load(open('$OUT/gemv_sweep.json'))['summary']['fp8 m=1']['best_gemv_blocks'])" 2>/dev/null)
echo "GEMV blocks for @BLOCKS: ${blocks:-the default}"
IFS=';' read -ra runs <<< "${RUNS:-tc=;gemv=--cuda-core-gemv-rows 4 @BLOCKS;gemv_fuse=--cuda-core-gemv-rows 4 @BLOCKS --fuse-fp8-quant}"
left_runs=${#runs[@]}
for item in "${runs[@]}"; do
  name=${item%%=*} flags=${item#*=}
  flags=${flags//@BLOCKS/${blocks:+--gemv-blocks $blocks}}
  left=$(( (budget - SECONDS - 10) / left_runs )); left_runs=$(( left_runs - 1 ))
  timeout "$left" python3 -m higgs_stream.bench_quant --sections model --modes fp8/kv8 --streams "" --greedy-steps 16 \
    --batches "${BATCHES:-1,16,64,256}" --budget-s $(( left - 10 )) --out "$OUT/step_$name.json" $flags 2>&1 \
    | tee -a "$OUT/step.log" | grep -E "decode b=|profile b=|Error|error" | sed "s/^/$name: /" | cut -c1-300
done
echo "done in $SECONDS s"
