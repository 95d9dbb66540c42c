#!/usr/bin/env bash
# One device call, one card: the load generator against this tree's server under several `serve` flag sets,
# one after the other (a fresh server each), same scenarios and seeds: an A/B of serving options; with
# BASELINE_DIR, then against an older tree's server too (label `base`, the first flag set).
# Usage (device tool, carry .whl; for a baseline also its folder):
#   CONFIGS="now=;pace3=--pause-ahead 3 --resume-ahead 2" bash scripts/gpu_loadgen_configs.sh
#   CONFIGS="new=" BASELINE_DIR=.baseline_s5 bash scripts/gpu_loadgen_configs.sh
# The baseline folder is a `git archive` of an older commit, made here with
#   mkdir -p .baseline_x && git archive REV engine kernels stream clients higgs_stream | tar -x -C .baseline_x
# and listed in .git/info/exclude. It runs through a shim package that links its folders, with the editable
# install removed (its finder wins over PYTHONPATH) and from /tmp (from the repo root this tree's own
# higgs_stream/ folder would be imported first); each run prints the module path it imported.
# Env (defaults): CONFIGS (required: label=flags, ';'-separated), BASELINE_DIR, BASELINE_FIRST=0 (1: the baseline's
#   server runs before this tree's: the A/B's order reversed, so a machine's drift shows), ROUNDS=1 (with BASELINE_DIR:
#   that many rounds of fresh servers, the trees' order alternating), ARCH=v2, OPEN_RATES="" (req/s),
#   CLOSED=128, DURATION=10, RAMP=1 (s over which closed-loop workers start; issue #10's burst: 2), MAX_FRAMES=250, MAX_STREAMS=256, KV_PAGES=8192, BUDGET_S=570 (runs that would not
#   fit are skipped), TRACE=1 (each server writes `--trace-out`: engine steps, codec calls, garbage collections),
#   PROFILE="LABEL ..." or "all" (those servers write `--profile-out`: every thread's stack sampled every 2 ms;
#   the sampler takes a little GIL time: profile a copy of a config, e.g. CONFIGS="now=;prof=" PROFILE=prof);
#   MODEL=random:tiny DEVICE=cpu try the script's plumbing without a GPU; CHECKPOINT="ARCH PRESET" (e.g. "qwen3-tts 1.7b")
#   serves a random checkpoint that `make-checkpoint` writes first in the real on-disk layout (MODEL and ARCH unused).
# Repeats: a load listed twice runs twice on the same server (CLOSED=128,128,128: three closed@128 runs; a run costs
#   its ~12 s scenario instead of a fresh server's ~65 s with its codec warm-up, session 27); alternate the configs
#   too (CONFIGS="a=;b=...;a2=;b2=...") so the machine's drift shows as spread. `scripts/plot_runs.py` takes every
#   repeat as a run and prints each config's median p95 and a rank-sum test against the first.
# Writes $OUT/configs.tgz (lg_<label>.json, server_<label>.log, trace_<label>.json); prints one line per
# scenario and run, where in the audio the stalls came, and each trace's summary (GC pauses included).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
repo=$PWD port=8110
model="--model ${MODEL:-random:full} --arch ${ARCH:-v2}"
if [ -n "${CHECKPOINT:-}" ]; then
  set -- $CHECKPOINT
  rm -rf /tmp/lg_ckpt  # a warm machine keeps the last call's
  python3 -m higgs_stream.cli make-checkpoint /tmp/lg_ckpt --arch "$1" --preset "$2" --seed 0 >"$OUT/make_ckpt.log" 2>&1 \
    || { tail -5 "$OUT/make_ckpt.log"; exit 1; }
  model="--model /tmp/lg_ckpt"
fi
run() {  # label flags: one fresh server, the scenarios against it (from $rundir)
  local label=$1 flags=$2 left=$(( ${BUDGET_S:-570} - SECONDS ))
  [ -n "${TRACE:-}" ] && flags+=" --trace-out $OUT/trace_$label.json"
  case " ${PROFILE:-} " in *" $label "*|*" all "*) flags+=" --profile-out $OUT/prof_$label.json";; esac
  if [ "$left" -lt 80 ]; then echo "$label: skipped ($left s left)"; return; fi
  (cd "$rundir" && python3 -c "import higgs_stream.stream.pipeline as p; print('$label code:', p.__file__)" && \
   timeout -k 10 $(( left - 5 )) python3 -m higgs_stream.loadgen --url "ws://127.0.0.1:$port/v1/tts/stream" \
    --spawn "python3 -m higgs_stream.cli serve $model --device ${DEVICE:-cuda} --drain-timeout 10 --host 127.0.0.1 --port $port --max-streams ${MAX_STREAMS:-256} --kv-pages ${KV_PAGES:-8192} --max-frames ${MAX_FRAMES:-250} $flags" \
    --spawn-log "$OUT/server_$label.log" --spawn-timeout 240 --time-budget $(( left - 60 )) --open-rates "${OPEN_RATES-}" \
    --closed "${CLOSED-128}" --duration "${DURATION:-10}" --ramp "${RAMP:-1}" --drain 20 --request-timeout 60 --procs 4 --label "$label" \
    --out "$OUT/lg_$label.json" 2>&1 | grep -E "^(open|closed)@" | sed "s/^/$label /")
  if [ ! -s "$OUT/lg_$label.json" ]; then  # the server never served (session 18: out of memory at its warm-up)
    echo "$label: no result; the server log's last unindented lines:"
    grep -v '^[[:space:]]' "$OUT/server_$label.log" 2>/dev/null | tail -3 | cut -c1-300
  fi
  port=$(( port + 1 ))
}
IFS=';' read -ra configs <<< "${CONFIGS:?set CONFIGS=label=flags;...}"
rundir=$repo rounds=${ROUNDS:-1}
if [ -n "${BASELINE_DIR:-}" ] && { [ "${BASELINE_FIRST:-0}" = 1 ] || [ "$rounds" -gt 1 ]; }; then
  # both trees through shims (the editable install removed), from /tmp; ROUNDS > 1 alternates their order round by
  # round (labels _r1, _r2, ...; the first round's order BASELINE_FIRST's): whichever server runs first on a machine
  # ran slower in session 34, so an A/B in one order measures the order too
  [ -d "$repo/$BASELINE_DIR/stream" ] || { echo "no baseline tree at $BASELINE_DIR"; exit 1; }
  python3 -m pip uninstall -y higgs-stream >/dev/null 2>&1
  shim_tree "$repo" /tmp/shim_now && shim_tree "$repo/$BASELINE_DIR" /tmp/shim_base  # device_env.sh
  rundir=/tmp pp=${PYTHONPATH:-} first=${configs[0]} base_first=${BASELINE_FIRST:-0}
  run_base() { PYTHONPATH=/tmp/shim_base:$pp run "base$1" "${first#*=}"; }
  run_now() { local item; for item in "${configs[@]}"; do PYTHONPATH=/tmp/shim_now:$pp run "${item%%=*}$1" "${item#*=}"; done; }
  for ((r = 1; r <= rounds; r++)); do
    sfx=""; [ "$rounds" -gt 1 ] && sfx="_r$r"
    if [ "$base_first" = 1 ]; then run_base "$sfx"; run_now "$sfx"; else run_now "$sfx"; run_base "$sfx"; fi
    base_first=$(( 1 - base_first ))
  done
  BASELINE_DIR=""
else
  for item in "${configs[@]}"; do run "${item%%=*}" "${item#*=}"; done
fi
if [ -n "${BASELINE_DIR:-}" ]; then
  [ -d "$repo/$BASELINE_DIR/stream" ] || { echo "no baseline tree at $BASELINE_DIR"; exit 1; }
  use_baseline "$repo/$BASELINE_DIR"  # device_env.sh
  rundir=/tmp
  first=${configs[0]}
  run base "${first#*=}"
fi
python3 - "$OUT" "$repo/higgs_stream/bench/trace.py" <<'PY'
import glob, importlib.util, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/lg_*.json")):
    d = json.load(open(f))
    if d.get("skipped"):  # the loadgen's time budget (BUDGET_S less start-up) could not fit them
        print(f.split("/")[-1], "SKIPPED for time:", d["skipped"], "(raise BUDGET_S; a fresh machine starts slower)")
    for s in d["scenarios"]:
        at = sorted(a for r in s["streams"] for a in r.get("stalls_at", []))
        print(f.split("/")[-1], s["name"], "stalls at (s of audio):", [round(a, 3) for a in at[:40]])
spec = importlib.util.spec_from_file_location("trace", sys.argv[2])  # this tree's, whichever tree ran last
trace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace)
for f in sorted(glob.glob(sys.argv[1] + "/trace_*.json")):
    ev = json.load(open(f))["events"]
    times = [e[1] for e in ev if e[0] in ("step", "codec")]
    s = trace.trace_summary(ev, wall_s=max(times) - min(times)) if times else {}
    print(f.split("/")[-1], {k: round(v, 2) if isinstance(v, float) else v for k, v in s.items()
                            if k.startswith(("gc_", "build", "step_ms", "codec_ms", "codec_busy", "codec_held", "steps", "codec_calls", "late_", "sync_"))})
PY
for p in "$OUT"/prof_*.json; do [ -e "$p" ] && python3 "$repo/scripts/top_samples.py" "$p" --top 12 | cut -c1-150; done
(cd "$OUT" && shopt -s nullglob && f=(lg_*.json server_*.log trace_*.json prof_*.json) && tar czf configs.tgz "${f[@]}" && rm -f "${f[@]}")
echo "done in $SECONDS s"
