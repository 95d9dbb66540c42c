#!/usr/bin/env bash
# One device call: every GPU test (v2 and v3), then `synth --device cuda` end to end on tiny v2/v3
# checkpoints (tiny head_dim 16 has no FlashInfer kernel: the fast path must refuse it with a clear
# error, and `--kernels ref` must run). Usage (device tool, carry .whl): bash scripts/gpu_check.sh   -> $OUT/gpu_tests.log
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/*_gpu.py tests/engine/*gpu*.py tests/engine/models/*/*gpu*.py tests/engine/models/*/*/*gpu*.py tests/engine/test_device_copy.py tests/stream/test_codec_graphs.py tests/stream/test_codec_worker_gpu.py tests/stream/test_kernel_builds_gpu.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -15
rc=$?
for arch in v2 v3; do
  python3 -m higgs_stream.cli make-checkpoint /tmp/tiny-$arch --arch $arch --preset tiny --seed 0 >/dev/null 2>&1
  refusal=$(python3 -m higgs_stream.cli synth --model /tmp/tiny-$arch --text "Hi." --device cuda --out /tmp/x.wav 2>&1)
  case "$refusal" in *"supports head_dim"*) echo "$arch fast path refuses head_dim 16: ok" ;;
                     *) echo "$arch: no clear refusal: $refusal"; rc=1 ;; esac
  python3 -m higgs_stream.cli synth --model /tmp/tiny-$arch --text "Hello there." --seed 1 --max-frames 50 \
    --device cuda --kernels ref --out "$OUT/synth-$arch.wav" 2>&1 | tail -1 || rc=1
done
exit $rc
