#!/usr/bin/env bash
# One device call (~9 min, one H100): the quantized paths' GPU tests, then the side-by-side benchmark
# of --quantize none|fp8|int8 on the full-size v2 talker (higgs_stream/bench_quant.py).
# Usage (device tool, carry .whl and .whl_bench):  bash scripts/gpu_quant.sh [bench_quant args]
# .whl_bench/ (ignored) holds torchao's wheel for the GEMM comparison only (the serving path does not
# use torchao), fetched once with
#   python -m pip download torchao==0.18.0 --no-deps -d .whl_bench
# Writes $OUT/{gpu.txt,pytest_quant.log,quant.json,quant.log} (quant.json merges quant_<mode>.json).
# Env: BUDGET_S (default 560), SKIP_TESTS=1 (bench only), TESTS_S (default 150), MODES (default: all four).
# Modes: none, fp8, int8, fp8/kv8 (fp8 K/V pages); the bench skips a mode's streaming runs when they
# would not leave time for the modes after it (quant.log says so): then run again with SKIP_TESTS=1.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
budget=${BUDGET_S:-560}
if ls .whl_bench/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_bench .whl_bench/*.whl \
    && export PYTHONPATH=/tmp/site_bench:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TESTS_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_quant_linear_gpu.py \
    tests/kernels/test_rope_kv_gpu.py tests/engine/test_quantize_gpu.py 2>&1 | tee "$OUT/pytest_quant.log" | tail -15
fi
# each mode in its own process (a mode's CUDA graphs and K/V pool are freed before the next allocates),
# then one merged quant.json with the targets
modes=${MODES:-none fp8 int8 fp8/kv8}
timeout $(( budget - SECONDS )) python3 -m higgs_stream.bench_quant --sections gemm --out /tmp/quant_gemm.json "$@" \
  2>&1 | tee "$OUT/quant.log" | grep -E "gemm .* m=(1|256):" | cut -c1-160
set -- $modes; n=$#; files=(/tmp/quant_gemm.json)
for m in $modes; do
  left=$(( (budget - SECONDS - 20) / n )); n=$(( n - 1 )); f="/tmp/quant_${m//\//_}.json"
  timeout "$left" python3 -m higgs_stream.bench_quant --sections model --modes "$m" --out "$f" --budget-s $(( left - 15 )) \
    2>&1 | tee -a "$OUT/quant.log" | grep -E "engine ready|decode b=(1|256):|stream n=|Error|error" | cut -c1-220
  [ -s "$f" ] && files+=("$f")
done
python3 -m higgs_stream.bench_quant --merge "${files[@]}" --out "$OUT/quant.json" 2>&1 | tail -60
echo "done in $SECONDS s"
