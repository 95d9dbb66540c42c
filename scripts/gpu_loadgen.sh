#!/usr/bin/env bash
# One device call: the load generator (higgs_stream/loadgen/, a real WebSocket client) against
# `serve --model random:full` (random weights, EOS suppressed: every utterance exactly MAX_FRAMES
# frames), v2 then v3. For each arch the load generator starts the server (--spawn), waits for
# /healthz (model build + graph capture + codec warm-up, ~1 min), runs the scenarios within its
# share of BUDGET_S (scenarios that would not fit are skipped and listed), and stops the server.
# Usage (device tool, carry .whl):  bash scripts/gpu_loadgen.sh
# Env (defaults): BUDGET_S=480 (the whole call), ARCHS="v2 v3", OPEN_RATES=1,5,10,20 (req/s; "" for none),
#   CLOSED=16,64,256,512 (streams), DURATION=10 (s of arrivals per scenario), DRAIN=20,
#   MAX_FRAMES=250 (10 s utterances), MAX_STREAMS=256 (the largest CUDA-graph batch; more is refused
#   as `busy`), KV_PAGES=8192, PROCS=4 (client processes), MODE (server default: exact);
#   SERVE_ARGS (more serve flags, e.g. "--codec-schedule just_in_time"; with LABEL to keep both runs),
#   MODEL=random:tiny DEVICE=cpu try the script's plumbing without a GPU.
# Writes $OUT/loadgen_<arch>.json, loadgen_<arch>.log (client), server_<arch>.log, gpu.txt, and
# loadgen.png when matplotlib is importable (else: python -m higgs_stream.loadgen --plot-from ... locally).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import aiohttp" || { echo "aiohttp is not importable here: carry its wheel (.whl)"; exit 1; }
archs=(${ARCHS:-v2 v3})
n=${#archs[@]} rc=0 port=8100
for arch in "${archs[@]}"; do
  share=$(( (${BUDGET_S:-480} - SECONDS - 15) / n )); n=$(( n - 1 ))
  if [ "$share" -lt 100 ]; then echo "$arch: skipped (${share} s of budget left for it)"; rc=1; continue; fi
  echo "== $arch: ${share} s"
  serve="python3 -m higgs_stream.cli serve --model ${MODEL:-random:full} --arch $arch --device ${DEVICE:-cuda} --drain-timeout 10"
  serve+=" --host 127.0.0.1 --port $port --max-streams ${MAX_STREAMS:-256} --kv-pages ${KV_PAGES:-8192} --max-frames ${MAX_FRAMES:-250} ${SERVE_ARGS:-}"
  timeout -k 20 $(( share + 45 )) python3 -m higgs_stream.loadgen --url "ws://127.0.0.1:$port/v1/tts/stream" \
    --spawn "$serve" --spawn-log "$OUT/server_$arch.log" --spawn-timeout 240 --time-budget "$share" \
    --open-rates "${OPEN_RATES-1,5,10,20}" --closed "${CLOSED-16,64,256,512}" --duration "${DURATION:-10}" \
    --drain "${DRAIN:-20}" --request-timeout 60 --procs "${PROCS:-4}" ${MODE:+--mode "$MODE"} --label "$arch${LABEL:+-$LABEL}" \
    --out "$OUT/loadgen_$arch${LABEL:+_$LABEL}.json" 2>&1 | tee "$OUT/loadgen_$arch.log" | grep -v "^\s*$" | tail -14 || rc=1
  tail -3 "$OUT/server_$arch.log"
  port=$(( port + 1 ))
done
ls "$OUT"/loadgen_v*.json >/dev/null 2>&1 && { python3 -m higgs_stream.loadgen --plot-from "$OUT"/loadgen_v*.json \
  --plot "$OUT/loadgen.png" >/dev/null 2>&1 || echo "no plot on this machine (matplotlib?): run --plot-from locally"; }
echo "done in ${SECONDS} s"
exit $rc
