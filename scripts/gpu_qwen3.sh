#!/usr/bin/env bash
# One device call (issue #13, Qwen3-TTS on CUDA): the GPU tests (Qwen3-TTS's ModelRunner: graph replay ==
# eager, fast vs reference kernels, streams together == alone; then every other engine GPU test, the
# shared code changed under them), the frame-step sweep of the full-size random talkers (0.6B, 1.7B;
# a step = talker + 15 code-predictor sub-steps + sampling, one graph) beside a v2 control, then a
# full-size random CustomVoice checkpoint (0.6B, 1.7B) in the hub layout served for real and driven by the load
# generator (Poisson 1 and 20 req/s).
# Usage (device tool, carry .whl):  bash scripts/gpu_qwen3.sh
# Env: BUDGET_S (570), SKIP_TESTS=1 (no tests, no sweep), SKIP_SERVER=1, SERVE_PRESETS ("0.6b 1.7b")
# Writes $OUT/qwen3.tgz (tests log, bench JSONs and logs, load generator JSON/log, server log).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
budget=${BUDGET_S:-570}
d="$OUT/q"; mkdir -p "$d"
trap 'tar -czf "$OUT/qwen3.tgz" -C "$OUT" q && rm -rf "$d"' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$d/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/engine/models/qwen3_tts/test_model_runner_gpu.py \
    tests/engine/test_model_runner_gpu.py tests/engine/test_quantize_gpu.py 2>&1 | tee "$d/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|Error|max|argmax" | tail -25
  for preset in full 1.7b; do
    timeout 150 python3 -m higgs_stream.bench --arch qwen3-tts --preset "$preset" --sections decode \
      --batches 1,16,64,128,256 --out "$d/bench_qwen3_$preset.json" > "$d/bench_qwen3_$preset.log" 2>&1
    grep -E "decode b=|Error|error" "$d/bench_qwen3_$preset.log" | tail -7 | sed "s/^/$preset: /"
  done
  timeout 120 python3 -m higgs_stream.bench --sections decode --batches 1,16,64,128,256 --out "$d/bench_v2.json" \
    > "$d/bench_v2.log" 2>&1
  grep -E "decode b=" "$d/bench_v2.log" | tail -5 | sed "s/^/v2: /"
fi
[ "${SKIP_SERVER:-0}" = 1 ] && exit 0
set -- ${SERVE_PRESETS:-0.6b 1.7b}; n=$# port=8400
for preset in "$@"; do
  left=$(( (budget - SECONDS - 20) / n )); n=$(( n - 1 ))
  if [ "$left" -lt 120 ]; then echo "$preset server run skipped: ${left} s left"; continue; fi
  python3 -m higgs_stream.cli make-checkpoint /tmp/q-$preset --arch qwen3-tts --preset "$preset" --seed 0 \
    > "$d/make_$preset.log" 2>&1 || { tail -5 "$d/make_$preset.log"; continue; }
  serve="python3 -m higgs_stream.cli serve --model /tmp/q-$preset --device cuda --host 127.0.0.1 --port $port"
  serve+=" --max-streams 128 --max-frames 125"
  timeout -k 20 "$left" python3 -m higgs_stream.loadgen --url ws://127.0.0.1:$port/v1/tts/stream --spawn "$serve" \
    --spawn-log "$d/server_qwen3_$preset.log" --spawn-timeout 200 --time-budget $(( left - 30 )) --open-rates 1,20 \
    --closed "" --duration 10 --drain 20 --request-timeout 60 --procs 4 --label "qwen3-$preset" \
    --out "$d/loadgen_qwen3_$preset.json" 2>&1 | tee "$d/loadgen_qwen3_$preset.log" | grep -v "^\s*$" | tail -5
  grep -E "Error|Traceback" "$d/server_qwen3_$preset.log" | head -5
  port=$(( port + 1 ))
done
echo "done in $SECONDS s"
