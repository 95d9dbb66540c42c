#!/usr/bin/env bash
# One device call: scripts/first_uses.py against a freshly started server per model (each kind of request twice,
# one at a time: the first use's time to first audio against the second's, and the kernels built on the way).
# Usage (device tool, carry .whl): MODELS="v2 v3 qwen3-tts:1.7b-base" bash scripts/gpu_first_uses.sh
# Env: MODELS (v2 v3: `random:full`; FAMILY:PRESET: a random checkpoint `make-checkpoint` writes first), BUDGET_S (560).
# Writes $OUT/first_uses_<model>.json and the servers' logs.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
port=8130
for m in ${MODELS:-v2 v3}; do
  left=$(( ${BUDGET_S:-560} - SECONDS ))
  if [ "$left" -lt 120 ]; then echo "$m: skipped ($left s left)"; continue; fi
  tag=${m//[:.]/_}
  case "$m" in
    *:*) rm -rf /tmp/fu_ckpt
         python3 -m higgs_stream.cli make-checkpoint /tmp/fu_ckpt --arch "${m%%:*}" --preset "${m#*:}" --seed 0 \
           >"$OUT/make_ckpt_$tag.log" 2>&1 || { tail -3 "$OUT/make_ckpt_$tag.log"; continue; }
         model="--model /tmp/fu_ckpt" ;;
    *) model="--model random:full --arch $m" ;;
  esac
  echo "== $m"
  timeout -k 10 $(( left - 5 )) python3 scripts/first_uses.py --url "ws://127.0.0.1:$port/v1/tts/stream" \
    --spawn "python3 -m higgs_stream.cli serve $model --device cuda --drain-timeout 5 --host 127.0.0.1 --port $port --max-frames 250" \
    --spawn-log "$OUT/server_first_uses_$tag.log" --out "$OUT/first_uses_$tag.json" 2>&1 | grep -v "^\[loadgen"
  grep -h -E "built|warmed up" "$OUT/server_first_uses_$tag.log" | cut -c1-300
  port=$(( port + 1 ))
done
echo "done in $SECONDS s"
