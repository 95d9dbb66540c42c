#!/usr/bin/env bash
# One device call, one card: the talker benchmark of this tree and of a baseline tree, back to back
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
share=1; [ -d "$base" ] && share=2  # this tree gets half the budget when the baseline runs after it
timeout $(( ($(left) - 5) / share )) python3 -m higgs_stream.bench "${args[@]}" --out "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log" | grep -E "decode b=|stream n=|Error" | tail -12
if [ -d "$base" ]; then  # then the baseline, same card, same call (device_env.sh)
  use_baseline "$base"
  # from /tmp: `python -m` puts the working directory first on sys.path, and the repo's higgs_stream/ would win
  (cd /tmp && timeout $(( $(left) - 5 )) python3 -c \
    "import higgs_stream.engine.engine as e, sys; print('baseline code:', e.__file__); sys.argv[0] = 'bench'; \
from higgs_stream.bench import main; sys.exit(main(sys.argv[1:]))" "${args[@]}" --out "$OUT/baseline.json" \
    2>&1 | tee "$OUT/baseline.log" | grep -E "baseline code|decode b=|stream n=|Error" | tail -12)
fi
echo "done in $SECONDS s"
