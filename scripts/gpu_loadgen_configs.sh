#!/usr/bin/env bash
# One device call, one card: the load generator against this tree's server under several `serve` flag sets,
# one after the other (a fresh server each), same scenarios and seeds: an A/B of serving options.
# Usage (device tool, carry .whl):
#   CONFIGS="base=;call15=--codec-call-ms 15" bash scripts/gpu_loadgen_configs.sh
# Env (defaults): CONFIGS (required: label=flags, ';'-separated), ARCH=v2, OPEN_RATES="" (req/s), CLOSED=128,
#   DURATION=10, MAX_FRAMES=250, MAX_STREAMS=256, KV_PAGES=8192, BUDGET_S=570 (configs that would not fit are skipped),
#   TRACE=1 (each server writes `--trace-out`: engine steps, codec calls, garbage collections).
# Writes $OUT/configs.tgz (lg_<label>.json, server_<label>.log, trace_<label>.json); prints one line per
# scenario and config, where in the audio the stalls came, and the traced garbage-collection pauses.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
port=8110
IFS=';' read -ra configs <<< "${CONFIGS:?set CONFIGS=label=flags;...}"
for item in "${configs[@]}"; do
  label=${item%%=*} flags=${item#*=}
  [ -n "${TRACE:-}" ] && flags+=" --trace-out $OUT/trace_$label.json"
  left=$(( ${BUDGET_S:-570} - SECONDS ))
  if [ "$left" -lt 80 ]; then echo "$label: skipped ($left s left)"; continue; fi
  timeout -k 10 $(( left - 5 )) python3 -m higgs_stream.loadgen --url "ws://127.0.0.1:$port/v1/tts/stream" \
    --spawn "python3 -m higgs_stream.cli serve --model random:full --arch ${ARCH:-v2} --device cuda --host 127.0.0.1 --port $port --max-streams ${MAX_STREAMS:-256} --kv-pages ${KV_PAGES:-8192} --max-frames ${MAX_FRAMES:-250} $flags" \
    --spawn-log "$OUT/server_$label.log" --spawn-timeout 240 --time-budget $(( left - 60 )) --open-rates "${OPEN_RATES-}" \
    --closed "${CLOSED-128}" --duration "${DURATION:-10}" --drain 20 --request-timeout 60 --procs 4 --label "$label" \
    --out "$OUT/lg_$label.json" 2>&1 | grep -E "^(open|closed)@" | sed "s/^/$label /"
  port=$(( port + 1 ))
done
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/lg_*.json")):
    for s in json.load(open(f))["scenarios"]:
        at = sorted(a for r in s["streams"] for a in r.get("stalls_at", []))
        print(f.split("/")[-1], s["name"], "stalls at (s of audio):", [round(a, 3) for a in at[:40]])
from higgs_stream.bench import trace_summary
for f in sorted(glob.glob(sys.argv[1] + "/trace_*.json")):
    ev = json.load(open(f))["events"]
    times = [e[1] for e in ev if e[0] in ("step", "codec")]
    s = trace_summary(ev, wall_s=max(times) - min(times)) if times else {}
    print(f.split("/")[-1], {k: round(v, 2) if isinstance(v, float) else v for k, v in s.items()
                            if k.startswith(("gc_", "step_ms", "codec_ms", "codec_busy", "steps", "codec_calls"))})
PY
(cd "$OUT" && shopt -s nullglob && f=(lg_*.json server_*.log trace_*.json) && tar czf configs.tgz "${f[@]}" && rm -f "${f[@]}")
echo "done in $SECONDS s"
