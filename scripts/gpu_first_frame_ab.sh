#!/usr/bin/env bash
# One device call, one card: a lone request's first engine steps (wall ms each, kernels and device time
# of the prefill step and of a decode step: scripts/profile_first_step.py) and the decode-step sweep,
# for a baseline tree and for this tree, back to back, on Qwen3-TTS 1.7B and Higgs v2 (full size,
# random weights). Made for session 8's launch cuts (fused draw, the code predictor's index tensors and
# shared K/V heads); any tree pair works.
# Usage (device tool, carry .whl and the baseline folder):  BASELINE=.baseline_s8 bash scripts/gpu_first_frame_ab.sh
# .baseline_s8 (untracked): mkdir -p .baseline_s8 && git archive 44ff9e5 engine kernels stream clients higgs_stream | tar -x -C .baseline_s8
# Env: SKIP_THIS=1 (baseline only), BASELINE (default .baseline), MODELS (default "qwen3-tts:1.7b v2:full"), BATCHES (1,8,64,256).
# Writes $OUT/first_frame/{gpu.txt, <tree>_<arch>_first.txt, <tree>_<arch>_decode.json/.log}.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
base=${BASELINE:-.baseline}
d="$OUT/first_frame"; mkdir -p "$d"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$d/gpu.txt"
here=$(pwd)
run_tree() {  # run_tree LABEL: both models' first steps and decode sweep with the higgs_stream importable now
  local tree=$1 m arch preset
  (cd /tmp && python3 -c "import higgs_stream.engine.engine as e; print('$tree code:', e.__file__)")
  for m in ${MODELS:-qwen3-tts:1.7b v2:full}; do
    arch=${m%%:*} preset=${m##*:}
    # from /tmp: `python -m` puts the working directory first on sys.path, and the repo's higgs_stream/ would win
    (cd /tmp && timeout 200 python3 "$here/scripts/profile_first_step.py" --arch "$arch" --preset "$preset" \
      --out "$d/${tree}_${arch}_prof.txt" > "$d/${tree}_${arch}_first.txt" 2>&1)
    grep -E "steps of a lone|kernels|Error" "$d/${tree}_${arch}_first.txt" | sed "s/^/$tree: /"
    (cd /tmp && timeout 150 python3 -c "import sys; from higgs_stream.bench import main; sys.exit(main(sys.argv[1:]))" \
      --arch "$arch" --preset "$preset" --sections decode --batches "${BATCHES:-1,8,64,256}" \
      --out "$d/${tree}_${arch}_decode.json" > "$d/${tree}_${arch}_decode.log" 2>&1)
    grep -E "decode b=|Error" "$d/${tree}_${arch}_decode.log" | tail -5 | sed "s/^/$tree $arch: /"
  done
}
[ "${SKIP_THIS:-0}" = 1 ] || run_tree this  # the editable install (device_env.sh)
if [ -d "$base" ]; then  # then the baseline (device_env.sh)
  use_baseline "$base"
  run_tree base
else
  echo "no $base: baseline skipped"
fi
echo "done in $SECONDS s"
