#!/usr/bin/env bash
# One device call, one card: the talker benchmark of this tree and of a baseline tree, in alternating rounds
# (this, base, this, base, ...; issue #12 first: decode step sweep and in-process streams before and after a change).
# Usage (device tool, carry .whl and the baseline folder):  ROUNDS=2 BASELINE=.baseline_x bash scripts/gpu_bench_ab.sh
#   a flag's A/B in this tree alone (no baseline folder): ROUNDS=2 BASELINE=none BASE_ARGS="--bf16-gemv-rows 0" ...
# The baseline folder (untracked, listed in .git/info/exclude) holds an older commit's sources, made once here with
#   mkdir -p .baseline_x && git archive REV engine kernels stream clients higgs_stream | tar -x -C .baseline_x
# Every run is its own process; processes of the same code differ by a few per cent (docs/PERF.md, session 24), so
# with ROUNDS >= 2 that spread shows beside the A/B's difference: scripts/ab_rounds.py prints each batch's runs, the
# medians and whether the trees' ranges are apart.
# Writes $OUT/{gpu.txt,bench_rN.json,bench_rN.log,baseline_rN.json,baseline_rN.log,ab_rounds.json}.
# Env: BUDGET_S (default 580), ROUNDS (default 1), SECTIONS (default decode,stream), BATCHES (1,16,64,128),
#      STREAMS (16,64,128), BASELINE (default .baseline: the baseline tree's folder; none there: this tree alone),
#      MODEL_ARGS (e.g. "--arch qwen3-tts --preset 1.7b"), BASE_ARGS (flags the baseline runs add; without a baseline
#      folder the baseline is this tree with them).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
budget=${BUDGET_S:-580}
rounds=${ROUNDS:-1}
base=${BASELINE:-.baseline}
# shellcheck disable=SC2206  # MODEL_ARGS is a list of flags
args=(--sections "${SECTIONS:-decode,stream}" --batches "${BATCHES:-1,16,64,128}" --streams "${STREAMS:-16,64,128}"
      ${MODEL_ARGS:-})
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
# both trees through shim packages, run from /tmp (from the repo root its own higgs_stream/ folder would be imported
# first); with a baseline the editable install goes: its finder wins over PYTHONPATH
shim_tree . /tmp/shim_bench
trees=(bench) base_tree=
if [ -d "$base" ]; then base_tree=$base; elif [ -n "${BASE_ARGS:-}" ]; then base_tree=.; fi  # ".": other flags
if [ -n "$base_tree" ]; then
  python3 -m pip uninstall -y higgs-stream >/dev/null 2>&1
  shim_tree "$base_tree" /tmp/shim_baseline
  trees=(bench baseline)
fi
# shellcheck disable=SC2206  # BASE_ARGS is a list of flags
base_args=(${BASE_ARGS:-})
runs_left=$(( rounds * ${#trees[@]} ))
for r in $(seq 1 "$rounds"); do
  for tree in "${trees[@]}"; do
    share=$(( (budget - SECONDS - 10) / runs_left )); runs_left=$(( runs_left - 1 ))
    [ "$share" -lt 30 ] && { echo "round $r $tree: skipped (${share} s left for it)"; continue; }
    (cd /tmp && PYTHONPATH=/tmp/shim_$tree:$PYTHONPATH timeout "$share" python3 -c \
      "import higgs_stream.engine.engine as e, sys; print('$tree code:', e.__file__); sys.argv[0] = 'bench'; \
from higgs_stream.bench import main; sys.exit(main(sys.argv[1:]))" "${args[@]}" \
      $([ "$tree" = baseline ] && printf '%s ' "${base_args[@]}") --out "$OUT/${tree}_r$r.json" 2>&1 \
      | tee "$OUT/${tree}_r$r.log" | grep -E " code:|decode b=|stream n=|Error" | sed "s/^/[r$r $tree] /" | tail -14)
  done
done
python3 "$(dirname "$0")/ab_rounds.py" "$OUT" --json "$OUT/ab_rounds.json"
echo "done in $SECONDS s"
