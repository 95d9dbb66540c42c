#!/usr/bin/env bash
# Where the time goes at scale (issue #10): one device call. The in-process benchmark at N=128/256 with
# per-step/per-call traces (engine host time vs device waits, the talker replay's device time beside and
# apart from codec calls) and A/Bs in one process (codec on the talker's CUDA stream; GIL switch
# intervals), py-spy sampling of who holds the GIL, optionally the codec alone with a kernel breakdown.
# Usage (device tool; carry .whl and .diag (py-spy wheel)):  bash scripts/gpu_diag.sh
# Env: STREAMS (128,256), BENCH_ARGS (A/B flags of higgs_stream.bench), CODEC=1 (codec alone too).
# Writes $OUT/diag.tgz (every log and JSON: the device returns few files).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
mkdir -p "$OUT/d"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/d/gpu.txt"
python3 -m pip install -q --no-index --no-deps --target /tmp/diag .diag/*.whl 2>/dev/null && export PATH=/tmp/diag/bin:$PATH
if [ -n "${CODEC:-}" ]; then
  timeout 120 python3 -m higgs_stream.bench_codec --out "$OUT/d/codec.json" --batches 1,16,64,128 --steps 25,1 \
    --no-tf32 --profile 64:1,64:25 --stage-times 128:25,16:25 > "$OUT/d/codec.log" 2>&1
  grep -E "stateful|one_shot|^ *[0-9]+ (conv|res)" "$OUT/d/codec.log" | tail -60
fi
python3 -m higgs_stream.bench --sections stream --streams "${STREAMS:-128,256}" --low-latency-streams "" --trace \
  ${BENCH_ARGS:---compare-codec-sms 32,48} --out "$OUT/d/bench.json" > "$OUT/d/bench.log" 2>&1 &
pid=$!
if command -v py-spy >/dev/null; then
  sleep 75  # model build + warm-up first
  timeout 60 py-spy record --pid $pid --nonblocking --gil --threads --format raw --rate 250 --duration 40 \
    -o "$OUT/d/pyspy_gil.txt" > "$OUT/d/pyspy.log" 2>&1 || echo "py-spy failed: $(tail -2 "$OUT/d/pyspy.log")"
fi
timeout $(( ${BUDGET_S:-560} - SECONDS )) tail --pid=$pid -f /dev/null
kill $pid 2>/dev/null
grep -E "Error|error" "$OUT/d/bench.log" | tail -3
sed -n '/^ *N /,$p' "$OUT/d/bench.log"
python3 - "$OUT/d/bench.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])).get("stream", []):
    t = r.get("trace")
    if t:
        print(r["n"], r.get("codec_stream"), r.get("gil_switch_ms"), {k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items()})
PY
tar -czf "$OUT/diag.tgz" -C "$OUT" d && rm -rf "$OUT/d" "$OUT/install.log"
echo "done in $SECONDS s"
