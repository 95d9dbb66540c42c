#!/usr/bin/env bash
# Where the time goes at scale (issue #10): one device call. Codec GPU tests, the codec alone with a
# kernel breakdown, the in-process benchmark at N=128/256 with per-step/per-call traces and A/Bs
# (codec steps partitioned by width or not; codec on its own CUDA stream or the talker's), py-spy
# sampling of who holds the GIL, and the session-start pipeline as the same-card baseline.
# Usage (device tool; carry .whl, .diag (py-spy wheel) and the baseline dir):
#   BASELINE_DIR=.baseline_s0 bash scripts/gpu_diag.sh
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
budget=${BUDGET_S:-580}
left() { echo $(( budget - SECONDS )); }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pip install -q --no-index --no-deps --target /tmp/diag .diag/*.whl 2>/dev/null && export PATH=/tmp/diag/bin:$PATH
timeout 120 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/engine/test_codec_streaming_gpu.py 2>&1 \
  | tee "$OUT/pytest_gpu.log" | tail -3
timeout 120 python3 -m higgs_stream.bench_codec --out "$OUT/codec.json" --batches 1,16,64,128 --steps 25,1 --no-tf32 \
  --profile 64:1,64:25 2>&1 | tee "$OUT/codec.log" | grep -E "profile|stateful|one_shot|windowed|Error" | tail -20
STREAMS=${STREAMS:-128,256}
python3 -m higgs_stream.bench --sections stream --streams "$STREAMS" --low-latency-streams "" --trace \
  ${BENCH_ARGS:---compare-codec-partition} --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1 &
pid=$!
if command -v py-spy >/dev/null; then
  sleep 60  # model build + warm-up first
  timeout 100 py-spy record --pid $pid --nonblocking --gil --threads --format raw --rate 200 --duration 90 \
    -o "$OUT/pyspy_gil.txt" > "$OUT/pyspy.log" 2>&1 || echo "py-spy failed: $(tail -2 "$OUT/pyspy.log")"
fi
timeout $(( $(left) - 150 )) tail --pid=$pid -f /dev/null
kill $pid 2>/dev/null
grep -E "stream n=|Error|error" "$OUT/bench.log" | cut -c1-900 | tail -12
tail -12 "$OUT/bench.log"
if [ -n "${BASELINE_DIR:-}" ] && [ -d "$BASELINE_DIR" ]; then
  mkdir -p /tmp/shim_base/higgs_stream
  for d in engine kernels stream clients; do ln -sfn "$PWD/$BASELINE_DIR/$d" /tmp/shim_base/higgs_stream/$d; done
  for f in "$BASELINE_DIR"/higgs_stream/*.py; do ln -sf "$PWD/$f" /tmp/shim_base/higgs_stream/; done
  (cd /tmp && PYTHONPATH=/tmp/shim_base:$PYTHONPATH timeout $(( $(left) - 5 )) python3 -c \
    "import higgs_stream.stream.adapter as a, sys; print('baseline code:', a.__file__); sys.argv[0] = 'bench'; \
from higgs_stream.bench import main; sys.exit(main(['--sections', 'stream', '--streams', '$STREAMS', '--out', '$OUT/baseline.json']))" \
    > "$OUT/baseline.log" 2>&1; grep -E "baseline code|stream n=|Error" "$OUT/baseline.log" | cut -c1-400 | tail -9)
fi
echo "done in $SECONDS s"
