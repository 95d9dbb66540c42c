#!/usr/bin/env bash
# One device call, one card: the talker benchmark of a baseline tree and of this tree, back to back
# (issue #12: decode step sweep and in-process streams N=16/64/128 before and after the refactor).
# Usage (device tool, carry .whl and .baseline):  bash scripts/gpu_bench_ab.sh
# .baseline/ (untracked) holds the baseline's sources, made once here with
#   mkdir -p .baseline && git archive 8f7d251 engine kernels stream clients higgs_stream | tar -x -C .baseline
# (8f7d251: main just before issue #12 was merged, with the issue #10 work; a30c91e: with its steps 1-2)
# Writes $OUT/{gpu.txt,baseline.json,baseline.log,bench.json,bench.log}.
# Env: BUDGET_S (default 580), SECTIONS (default decode,stream), BATCHES (1,16,64,128), STREAMS (16,64,128),
#      BASELINE (default .baseline: the baseline tree's folder), MODEL_ARGS (e.g. "--arch qwen3-tts --preset 1.7b").
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
budget=${BUDGET_S:-580}
left() { echo $(( budget - SECONDS )); }
base=${BASELINE:-.baseline}
# shellcheck disable=SC2206  # MODEL_ARGS is a list of flags
args=(--sections "${SECTIONS:-decode,stream}" --batches "${BATCHES:-1,16,64,128}" --streams "${STREAMS:-16,64,128}"
      ${MODEL_ARGS:-})
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -d "$base" ]; then  # the baseline first, same card, same call
  shim_tree "$base" /tmp/shim_base
  # from /tmp: `python -m` puts the working directory first on sys.path, and the repo's higgs_stream/ would win
  (cd /tmp && PYTHONPATH=/tmp/shim_base:$PYTHONPATH timeout $(( $(left) / 2 )) python3 -c \
    "import higgs_stream.engine.engine as e, sys; print('baseline code:', e.__file__); sys.argv[0] = 'bench'; \
from higgs_stream.bench import main; sys.exit(main(sys.argv[1:]))" "${args[@]}" --out "$OUT/baseline.json" \
    2>&1 | tee "$OUT/baseline.log" | grep -E "baseline code|decode b=|stream n=|Error" | tail -12)
fi
timeout $(( $(left) - 5 )) python3 -m higgs_stream.bench "${args[@]}" --out "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log" | grep -E "decode b=|stream n=|Error" | tail -12
echo "done in $SECONDS s"
