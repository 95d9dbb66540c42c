#!/usr/bin/env bash
# One device call: is the serving loop host-bound? Two `serve --model random:full` processes on one
# GPU under CUDA MPS, each given half the load, against one process given all of it (the baseline,
# same call, same card, both servers already resident under MPS). Real WebSocket clients
# (higgs_stream.loadgen), closed loop. The MPS control daemon is started here and always quit on
# exit; no card setting (compute mode, clocks, ...) is touched.
# Usage (device tool, carry .whl):  bash scripts/gpu_mps.sh     Env: N (total streams, 128), DURATION (10)
# Writes $OUT/mps_one.json, mps_a.json, mps_b.json, server_{a,b}.log, mps.log.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
N=${N:-128}; DURATION=${DURATION:-10}
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null; done
  sleep 3
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  echo quit | nvidia-cuda-mps-control 2>/dev/null
  cp "$CUDA_MPS_LOG_DIRECTORY"/control.log "$OUT/mps.log" 2>/dev/null
}
trap cleanup EXIT
nvidia-smi --query-gpu=name,compute_mode --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-cuda-mps-control -d || { echo "MPS daemon did not start"; exit 1; }
for s in a b; do
  port=$([ $s = a ] && echo 8200 || echo 8201)
  python3 -m higgs_stream.cli serve --model random:full --device cuda --host 127.0.0.1 --port $port \
    --max-streams 256 --kv-pages 8192 --max-frames 250 >"$OUT/server_$s.log" 2>&1 &
  pids+=($!)
done
for port in 8200 8201; do  # both resident before anything is measured
  for i in $(seq 1 240); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/healthz', timeout=2)" 2>/dev/null && break
    sleep 1
  done
done
echo "servers up after $SECONDS s"
lg() { python3 -m higgs_stream.loadgen --url "ws://127.0.0.1:$1/v1/tts/stream" --open-rates "" --closed "$2" \
         --duration "$DURATION" --drain 25 --request-timeout 60 --procs 4 --label "$3" --out "$OUT/$4.json" 2>&1 \
         | grep -E "^closed@|^scenario" ; }
echo "== one process, closed@$N"; lg 8200 "$N" one mps_one
echo "== two processes under MPS, closed@$((N / 2)) each"
lg 8200 $((N / 2)) a mps_a & la=$!
lg 8201 $((N / 2)) b mps_b & lb=$!
wait $la $lb
echo "done in $SECONDS s"
