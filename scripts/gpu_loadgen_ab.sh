#!/usr/bin/env bash
# One device call, one card: the load generator against this tree's server, then a baseline tree's,
# back to back (default: v2, closed loop 128, random full-size weights, 10 s utterances).
# Usage (device tool, carry .whl and the baseline folder):  BASELINE_DIR=.baseline_s4 bash scripts/gpu_loadgen_ab.sh
# The baseline folder is a `git archive` of an older commit, made here with
#   mkdir -p .baseline_x && git archive REV engine kernels stream clients higgs_stream | tar -x -C .baseline_x
# and listed in .git/info/exclude. How the baseline runs (session 4's first try ran this tree twice):
# the editable install is removed (its finder wins over PYTHONPATH), a shim package links the baseline's
# folders, and every command runs from /tmp (from the repo root, its own higgs_stream/ folder would be
# imported first, without engine/ or stream/); the script prints the module path it imported.
# Env (defaults): BASELINE_DIR (required), ARCH=v2, OPEN_RATES="" (req/s), CLOSED=128, DURATION=10,
#   MAX_FRAMES=250, MAX_STREAMS=256, KV_PAGES=8192.
# Writes $OUT/lg_new.json, lg_base.json, server_new.log, server_base.log.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
repo=$PWD
base="${BASELINE_DIR:?set BASELINE_DIR to the baseline tree (a git archive, carried)}"
[ -d "$repo/$base/stream" ] || { echo "no baseline tree at $base"; exit 1; }
lg() {  # label port
  (cd /tmp && python3 -c "import higgs_stream.stream.pipeline as p; print('$1 code:', p.__file__)" && \
   timeout 330 python3 -m higgs_stream.loadgen --url "ws://127.0.0.1:$2/v1/tts/stream" \
     --spawn "python3 -m higgs_stream.cli serve --model random:full --arch ${ARCH:-v2} --device cuda --host 127.0.0.1 --port $2 --max-streams ${MAX_STREAMS:-256} --kv-pages ${KV_PAGES:-8192} --max-frames ${MAX_FRAMES:-250}" \
     --spawn-log "$OUT/server_$1.log" --spawn-timeout 240 --time-budget 240 --open-rates "${OPEN_RATES-}" \
     --closed "${CLOSED-128}" --duration "${DURATION:-10}" --drain 20 --request-timeout 60 --procs 4 --label "$1" \
     --out "$OUT/lg_$1.json" 2>&1 | grep -E "^(open|closed)@" | sed "s/^/$1 /")
}
lg new 8101
python3 -m pip uninstall -y higgs-stream >/dev/null 2>&1
rm -rf /tmp/shim_base && mkdir -p /tmp/shim_base/higgs_stream
for d in engine kernels stream clients; do ln -sfn "$repo/$base/$d" "/tmp/shim_base/higgs_stream/$d"; done
for f in "$repo/$base"/higgs_stream/*; do ln -sfn "$f" /tmp/shim_base/higgs_stream/; done
export PYTHONPATH=/tmp/shim_base:$PYTHONPATH
lg base 8102
echo "done in $SECONDS s"
