#!/usr/bin/env bash
# One device call (one GPU): the decode attention kernels' GPU tests (FlashInfer's two, our Triton kernel, the
# model runner on each, the engine's no-sync guard) and the fused fp8 quantization's, then scripts/bench_attention.py
# over bf16 and fp8 pages.
# Usage (device tool, carry .whl):
#   [TRITON="64x4x1,64x4x1r,64x4x1r4"] [BATCHES=1,16,64,128,256] [CONTEXTS=300,1000] [TESTS="FILES"] bash scripts/gpu_attention.sh
# Then, with STEP=1, the whole v2 decode step (bench_quant: parity, end-of-speech guard, replayed decode sweep, one
# profiled step; no streaming runs) for each "MODE TRITON_FROM [bench_quant flags]" of STEP_RUNS (';'-separated;
# TRITON_FROM 'none': FlashInfer's decode at every batch; e.g. "fp8/kv8 64 --no-fuse-fp8-quant"), in the same call, at
# STEP_BATCHES rows (default 1,64,128,256).
# Writes $OUT/{gpu.txt,tests.log,attn.json,attn.log,step_*.json,step.log}.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TESTS_S:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests/kernels/test_paged_decode_gpu.py \
    tests/kernels/test_flashinfer_attention_gpu.py tests/engine/test_model_runner_gpu.py tests/kernels/test_fused_norm_gpu.py \
    tests/kernels/test_activation_gpu.py tests/engine/test_quantize_gpu.py::test_fused_fp8_quantization_gives_the_same_logits} \
    2>&1 | tee "$OUT/tests.log" | tail -8
fi
timeout "${ATTN_S:-240}" python3 scripts/bench_attention.py --batches "${BATCHES:-1,16,64,128,256}" \
  --contexts "${CONTEXTS:-300,1000}" --triton "${TRITON:-64x4x1,64x4x1r,64x4x1r4}" --out "$OUT/attn.json" 2>&1 | tee "$OUT/attn.log" \
  | grep -E "attn " | sed -E 's/floor_us_per_layer/floor/; s/bandwidth_share/share/; s/max_rel_diff_vs_cuda_cores/diff/' | cut -c1-150
if [ "${STEP:-0}" = 1 ]; then
  IFS=';' read -ra runs <<< "${STEP_RUNS:-none 64;fp8/kv8 64;fp8/kv8 64 --no-fuse-fp8-quant;none none}"
  for run in "${runs[@]}"; do
    set -- $run; mode=$1 from=$2; shift 2; tag=$(echo "$*" | tr -dc 'a-z0-9')
    f="$OUT/step_${mode//\//_}_triton${from}${tag:+_$tag}.json"
    timeout "${STEP_S:-110}" python3 -m higgs_stream.bench_quant --sections model --modes "$mode" --triton-decode-from "$from" "$@" \
      --streams "" --greedy-steps 16 --batches "${STEP_BATCHES:-1,64,128,256}" --profile-batches "${PROFILE:-256}" --out "$f" \
      2>&1 | tee -a "$OUT/step.log" | grep -E "engine ready|decode b=|profile b=.* by group|parity|Error|error" | cut -c1-200
  done
fi
[ -s "$OUT/install.log" ] || rm -f "$OUT/install.log"  # the device tool returns at most 8 files
if [ "${STEP:-0}" = 1 ]; then  # one file for every step run
  python3 - "$OUT" <<'PY'
import glob, json, os, sys
files = sorted(glob.glob(os.path.join(sys.argv[1], "step_*.json")))
json.dump({os.path.basename(f)[5:-5]: json.load(open(f)) for f in files}, open(os.path.join(sys.argv[1], "steps.json"), "w"))
for f in files:
    os.remove(f)
PY
fi
[ -f "$OUT/tests.log" ] && tail -3 "$OUT/tests.log"
echo "done in $SECONDS s"
