#!/usr/bin/env bash
# One device call for issue #10 (real time at scale): GPU tests of the stateful codec, the codec
# alone (stateful vs windowed vs one-shot), the in-process streaming benchmark, and the same
# benchmark of the previous (windowed) pipeline as the baseline on the same card.
# Usage (device tool, carry .whl and .baseline):  bash scripts/gpu_realtime.sh
# This tree runs first; the baseline runs after, through `use_baseline` (device_env.sh: editable install
# removed, a shim first on PYTHONPATH, from /tmp), so its figures are the baseline's own (before session
# 10 it ran with the editable install present and could import this tree).
# .baseline/ (git-ignored) holds the previous pipeline's sources, made once here with
#   mkdir -p .baseline && git archive 6fb90ea engine kernels stream clients higgs_stream | tar -x -C .baseline
# Writes $OUT/{gpu.txt,pytest_gpu.log,codec.json,codec.log,bench.json,bench.log,baseline.json,baseline.log}.
# Env: BUDGET_S (default 580), STREAMS (default 1,16,64,128,256), BASELINE_STREAMS (64,128; empty: skip),
# BASELINE_DIR (default .baseline: another `git archive` of an older commit, made the same way), BENCH_ARGS,
# SECTIONS (default stream; decode,stream adds the decode-step sweep to both), CODEC=0 skips the codec alone,
# CODEC_TESTS=0 skips its GPU tests,
# CODEC_BASELINE=1 runs the codec alone of BASELINE_DIR's tree too ($OUT/codec_base.{json,log}), STREAMS=none
# skips the in-process benchmark.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
budget=${BUDGET_S:-580}
left() { echo $(( budget - SECONDS )); }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${CODEC:-1}" = 1 ]; then
  [ "${CODEC_TESTS:-1}" = 1 ] && timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/engine/test_codec_streaming_gpu.py \
    tests/stream/test_codec_graphs.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -8
  timeout 120 python3 -m higgs_stream.bench_codec --out "$OUT/codec.json" 2>&1 | tee "$OUT/codec.log" | tail -25
fi
bdir=${BASELINE_DIR:-.baseline}
sections=${SECTIONS:-stream}
base=${BASELINE_STREAMS-64,128}
if [ "${STREAMS:-}" != none ]; then  # this tree's in-process benchmark first, then the baseline's runs
  reserve=$([ -n "$base" ] && [ -d "$bdir" ] && echo ${BASELINE_RESERVE:-170} || echo 0)
  timeout $(( $(left) - reserve )) python3 -m higgs_stream.bench --sections "$sections" --streams "${STREAMS:-1,16,64,128,256}" \
    ${BENCH_ARGS:-} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | grep -E "stream n=|ready|error|Error" | tail -30
fi
want_base=$([ "${CODEC_BASELINE:-0}" = 1 ] || { [ -n "$base" ] && [ "${STREAMS:-}" != none ]; } && echo 1 || echo 0)
if [ "$want_base" = 1 ] && [ -d "$bdir" ]; then
  # the baseline tree from here on, editable install removed (its finder would win over PYTHONPATH: the
  # "baseline" could import this tree), run from /tmp (the repo root's higgs_stream/ would win too)
  use_baseline "$bdir"  # device_env.sh
  (cd /tmp && python3 -c "import higgs_stream.stream.adapter as a; print('baseline code:', a.__file__)")
  if [ "${CODEC_BASELINE:-0}" = 1 ]; then
    (cd /tmp && timeout 120 python3 -m higgs_stream.bench_codec --out "$OUT/codec_base.json" 2>&1 \
      | tee "$OUT/codec_base.log" | tail -25)
  fi
  if [ -n "$base" ] && [ "${STREAMS:-}" != none ]; then  # the previous pipeline, same card, same call
    (cd /tmp && timeout $(( $(left) - 5 )) python3 -c \
      "import sys; sys.argv[0] = 'bench'; from higgs_stream.bench import main; \
sys.exit(main(['--sections', '$sections', '--batches', '1,32,64,128,256', '--streams', '$base', '--out', '$OUT/baseline.json']))" \
      2>&1 | tee "$OUT/baseline.log" | grep -E "stream n=|Error" | tail -9)
  fi
fi
echo "done in $SECONDS s"
