#!/usr/bin/env bash
# One device call (issue #13, Qwen3-TTS on CUDA): the GPU tests (Qwen3-TTS's ModelRunner: graph replay ==
# eager, fast vs reference kernels, streams together == alone; then every other engine GPU test, the
# shared code changed under them), the frame-step sweep of the full-size random talkers (0.6B, 1.7B;
# a step = talker + 15 code-predictor sub-steps + sampling, one graph) beside a v2 control, then a
# full-size random CustomVoice checkpoint (0.6B, 1.7B) in the hub layout served for real and driven by the load
# generator (Poisson 1 and 20 req/s).
# REF=1 adds the reference comparison (issue #13: >= 10x the official package's own generation, same GPU, same
# run): scripts/qwen3_reference_bench.py (PyPI qwen-tts 0.1.1 under its transformers 4.57.3, from the wheels of
# scripts/qwen3_ref_wheels.sh in /tmp/site_qref, first on PYTHONPATH in that subprocess alone) at 0.6B and 1.7B,
# beside our frame step at batch 1 and 8 (the sweep's JSON when this call made it), and the ratio per size.
# Usage (device tool, carry .whl):  bash scripts/gpu_qwen3.sh
#   reference comparison alone (carry .whl and .whl_qref):  REF=1 SKIP_TESTS=1 SKIP_SERVER=1 bash scripts/gpu_qwen3.sh
# Env: BUDGET_S (570), MAX_STREAMS (256), SERVE_ARGS (more serve flags, e.g. "--codec-precision tf32"),
#      TAG (appended to the output names), SKIP_TESTS=1 (no tests, no sweep), SKIP_SERVER=1, SERVE_PRESETS ("0.6b 1.7b"),
#      REF=1, REF_FRAMES (64: frames per reference run)
# Writes $OUT/qwen3$TAG.tgz (tests log, bench JSONs and logs, reference JSONs/logs and ref_ratio.json, load generator
# JSON/log, server log).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
budget=${BUDGET_S:-570}
d="$OUT/q"; mkdir -p "$d"
trap 'tar -czf "$OUT/qwen3${TAG:-}.tgz" -C "$OUT" q && rm -rf "$d"' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$d/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/engine/models/qwen3_tts/test_model_runner_gpu.py \
    tests/engine/test_model_runner_gpu.py tests/engine/test_quantize_gpu.py 2>&1 | tee "$d/gpu_tests.log" \
    | grep -E "passed|failed|FAILED|Error|max|argmax" | tail -25
  for preset in full 1.7b; do
    timeout 150 python3 -m higgs_stream.bench --arch qwen3-tts --preset "$preset" --sections decode \
      --batches 1,16,64,128,256 --out "$d/bench_qwen3_$preset.json" > "$d/bench_qwen3_$preset.log" 2>&1
    grep -E "decode b=|Error|error" "$d/bench_qwen3_$preset.log" | tail -7 | sed "s/^/$preset: /"
  done
  timeout 120 python3 -m higgs_stream.bench --sections decode --batches 1,16,64,128,256 --out "$d/bench_v2.json" \
    > "$d/bench_v2.log" 2>&1
  grep -E "decode b=" "$d/bench_v2.log" | tail -5 | sed "s/^/v2: /"
fi
if [ "${REF:-0}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_qref \
    .whl_qref/*.whl > "$d/ref_install.log" 2>&1 \
    || { echo "REF: installing .whl_qref failed (carry .whl_qref)"; tail -3 "$d/ref_install.log"; }
  for size in 0.6b 1.7b; do
    preset=$([ "$size" = 0.6b ] && echo full || echo 1.7b)  # higgs_stream.bench's preset names
    ours="$d/bench_qwen3_$preset.json"
    if [ ! -f "$ours" ]; then
      ours="$d/bench_qwen3_${preset}_ref.json"
      timeout 150 python3 -m higgs_stream.bench --arch qwen3-tts --preset "$preset" --sections decode --batches 1,8 \
        --out "$ours" > "${ours%.json}.log" 2>&1
      grep -E "decode b=|Error|error" "${ours%.json}.log" | tail -3 | sed "s/^/ours $size: /"
    fi
    # the reference's own transformers (4.57.3) must win over the machine's 5.x: its folder alone, first
    PYTHONPATH=/tmp/site_qref timeout 300 python3 scripts/qwen3_reference_bench.py --size "$size" \
      --frames "${REF_FRAMES:-64}" --out "$d/ref_qwen3_$size.json" > "$d/ref_qwen3_$size.log" 2>&1
    grep -E "^reference|Error|error" "$d/ref_qwen3_$size.log" | tail -4
    python3 - "$size" "$ours" "$d/ref_qwen3_$size.json" "$d/ref_ratio.json" <<'PY'
import json, os, sys
size, ours_path, ref_path, out_path = sys.argv[1:]
try:
    ours = {r["batch"]: r for r in json.load(open(ours_path))["decode"]}
    ref = {r["batch"]: r for r in json.load(open(ref_path))["results"]}
except (OSError, KeyError, ValueError) as e:
    sys.exit(print(f"ratio {size}: missing result ({e})"))
rows = json.load(open(out_path)) if os.path.exists(out_path) else []
for b in sorted(set(ours) & set(ref)):
    o, r = ours[b], ref[b]
    step, replay = o["frames_per_s"], b / (o["replay_ms"] / 1e3)  # full step (host + replay); graph replay alone
    rows.append(dict(size=size, batch=b, ours_step_frames_per_s=step, ours_replay_frames_per_s=replay,
                     ours_step_ms=o["step_ms"], ours_replay_ms=o["replay_ms"], ref_frames_per_s=r["frames_per_s"],
                     ref_ms_per_frame=r["ms_per_frame"], ratio_step=step / r["frames_per_s"],
                     ratio_replay=replay / r["frames_per_s"]))
    print(f"ratio {size} b={b}: ours {step:.1f} frames/s (step {o['step_ms']:.2f} ms, replay {o['replay_ms']:.2f} ms) "
          f"vs reference {r['frames_per_s']:.1f} frames/s ({r['ms_per_frame']:.1f} ms/frame): "
          f"{step / r['frames_per_s']:.1f}x (replay alone {replay / r['frames_per_s']:.1f}x)")
json.dump(rows, open(out_path, "w"), indent=2)
PY
  done
fi
[ "${SKIP_SERVER:-0}" = 1 ] && exit 0
set -- ${SERVE_PRESETS:-0.6b 1.7b}; n=$# port=8400
for preset in "$@"; do
  left=$(( (budget - SECONDS - 20) / n )); n=$(( n - 1 ))
  if [ "$left" -lt 120 ]; then echo "$preset server run skipped: ${left} s left"; continue; fi
  python3 -m higgs_stream.cli make-checkpoint /tmp/q-$preset --arch qwen3-tts --preset "$preset" --seed 0 \
    > "$d/make_$preset.log" 2>&1 || { tail -5 "$d/make_$preset.log"; continue; }
  serve="python3 -m higgs_stream.cli serve --model /tmp/q-$preset --device cuda --drain-timeout 10 --host 127.0.0.1 --port $port"
  tag="$preset${TAG:-}"
  serve+=" --max-streams ${MAX_STREAMS:-256} --max-frames 125 --trace-out $d/trace_qwen3_$tag.json ${SERVE_ARGS:-}"
  timeout -k 20 "$left" python3 -m higgs_stream.loadgen --url ws://127.0.0.1:$port/v1/tts/stream --spawn "$serve" \
    --spawn-log "$d/server_qwen3_$tag.log" --spawn-timeout 200 --time-budget $(( left - 30 )) --open-rates 1,20 \
    --closed "" --duration 10 --drain 20 --request-timeout 60 --procs 4 --label "qwen3-$tag" \
    --out "$d/loadgen_qwen3_$tag.json" 2>&1 | tee "$d/loadgen_qwen3_$tag.log" | grep -v "^\s*$" | tail -5
  grep -E "Error|Traceback" "$d/server_qwen3_$tag.log" | head -5
  # where first audio went, in streams that ran alone (the 1 req/s phase)
  [ -f "$d/trace_qwen3_$tag.json" ] && python3 scripts/ttfa_breakdown.py "$d/trace_qwen3_$tag.json" --alone \
    --json "$d/ttfa_breakdown_$tag.json"
  port=$(( port + 1 ))
done
echo "done in $SECONDS s"
