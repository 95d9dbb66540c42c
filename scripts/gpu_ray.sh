#!/usr/bin/env bash
# One device call on a host with two GPUs (kind nvidia-h100-x2): the load generator
# (higgs_stream/loadgen/, a real WebSocket client) with the same scenarios against
#   standalone  `serve` on GPU 0 (the aiohttp server),
#   ray2        `serve --ray --replicas 2` (Ray Serve, one replica per GPU, clients through the proxy),
#   ray1        `serve --ray --replicas 1` on GPU 0 (optional: the proxy's cost at equal capacity),
# all `--model random:full` (random full-size weights, EOS suppressed: every utterance MAX_FRAMES frames).
# The question (issue #15): do two replicas carry ~2x the zero-underrun streams of one at the same TTFA
# p95, and what does the proxy add to TTFA (ray vs standalone at a low rate)? $OUT/ray_summary.txt.
#
# Usage (device tool: kind nvidia-h100-x2, carry .whl and .whl_ray):  bash scripts/gpu_ray.sh
#   .whl: FlashInfer (bash ../shared/device/wheels.sh); .whl_ray: Ray Serve for Python 3.12 (bash
#   scripts/ray_wheels.sh, ~39 MiB; together with .whl and the tree ~61 MiB of the 64 a call carries).
#   If they do not fit together: one call `RUNS= bash scripts/gpu_ray.sh` carrying only .whl_ray installs
#   Ray into /tmp/site_ray, and the next call on the same warm machine carries only .whl.
# Env (defaults): RUNS="standalone ray2" (add ray1 if the budget allows), BUDGET_S=570 (the whole call),
#   ARCH=v2, OPEN_RATES=5,20 (req/s), CLOSED=128,256,384,512 (streams), DURATION=10 (s of arrivals per
#   scenario), DRAIN=20, MAX_FRAMES=250 (10 s utterances), MAX_STREAMS=256 (per server / replica),
#   KV_PAGES=8192, PROCS=8 (client processes), MODE (server default: exact);
#   LOCAL=1 PY=.venv/bin/python MODEL=random:tiny DEVICE=cpu GPUS=0 CPUS_PER_REPLICA=0 try the plumbing here.
# Writes $OUT/loadgen_<run>.json, loadgen_<run>.log (client), server_<run>.log, gpu.txt, ray_summary.txt.
set -uo pipefail
PY=${PY:-python3}
if [ "${LOCAL:-0}" = 1 ]; then
  OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
else
  if [ -d .whl_ray ] && ls .whl_ray/*.whl >/dev/null 2>&1; then
    t=$SECONDS
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_ray \
      .whl_ray/*.whl || exit 1
    echo "Ray Serve installed from .whl_ray into /tmp/site_ray in $(( SECONDS - t )) s"
  fi
  if [ -z "${RUNS-x}" ]; then echo "RUNS is empty: Ray installed, nothing else to run"; exit 0; fi
  . "$(dirname "$0")/device_env.sh"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
  export PYTHONPATH=/tmp/site_ray:$PYTHONPATH  # Ray's workers inherit it
fi
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=higgs_stream.stream.ray_app:proxy_middlewares
$PY -c "import ray, starlette, uvicorn, grpc, google.protobuf as pb; print('ray', ray.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)" \
  || { echo "Ray Serve is not importable: carry .whl_ray (bash scripts/ray_wheels.sh)"; exit 1; }
$PY -c "import aiohttp" || { echo "aiohttp is not importable here: carry its wheel (.whl)"; exit 1; }

runs=(${RUNS-standalone ray2})
common="--model ${MODEL:-random:full} --arch ${ARCH:-v2} --device ${DEVICE:-cuda} --max-streams ${MAX_STREAMS:-256}"
common+=" --kv-pages ${KV_PAGES:-8192} --max-frames ${MAX_FRAMES:-250} ${MODE:+--mode $MODE}"
load="--open-rates ${OPEN_RATES:-5,20} --closed ${CLOSED:-128,256,384,512} --duration ${DURATION:-10}"
load+=" --drain ${DRAIN:-20} --request-timeout 60 --procs ${PROCS:-8} ${MODE:+--mode $MODE}"
gpus=${GPUS:-1}
n=${#runs[@]} rc=0 port=8300

stop_group() {  # SIGTERM the server (serve --ray shuts Serve and its local Ray down), then its whole group
  local pid=$1
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -0 "$pid" 2>/dev/null && echo "server $pid still up 60 s after SIGTERM: SIGKILL to its process group"
  kill -KILL -- -"$pid" 2>/dev/null  # what Ray left behind in the server's session (setsid), if anything
  return 0
}

for run in "${runs[@]}"; do
  share=$(( (${BUDGET_S:-570} - SECONDS - 10) / n )); n=$(( n - 1 ))
  if [ "$share" -lt 150 ]; then echo "$run: skipped (${share} s of budget left for it)"; rc=1; continue; fi
  echo "== $run: ${share} s"
  url="ws://127.0.0.1:$port/v1/tts/stream"
  case $run in
    standalone)
      CUDA_VISIBLE_DEVICES=0 timeout -k 20 $(( share + 30 )) $PY -m higgs_stream.loadgen --url "$url" \
        --spawn "$PY -m higgs_stream.cli serve $common --host 127.0.0.1 --port $port" \
        --spawn-log "$OUT/server_$run.log" --spawn-timeout 300 --time-budget "$share" $load --gpu-index 0 \
        --label "$run" --out "$OUT/loadgen_$run.json" 2>&1 | tee "$OUT/loadgen_$run.log" | grep -v "^\s*$" | tail -12 \
        || rc=1
      ;;
    ray1|ray2)
      replicas=${run#ray}
      t0=$SECONDS left=0
      visible=$([ "$replicas" = 1 ] && echo 0 || echo "${CUDA_VISIBLE_DEVICES:-0,1}")
      CUDA_VISIBLE_DEVICES=$visible setsid $PY -m higgs_stream.cli serve --ray $common --host 127.0.0.1 --port $port \
        --replicas "$replicas" --gpus-per-replica "$gpus" --cpus-per-replica "${CPUS_PER_REPLICA:-4}" --max-queued 1024 --drain-timeout 30 \
        > "$OUT/server_$run.log" 2>&1 &
      server=$!
      until grep -q "^ready:" "$OUT/server_$run.log"; do
        if ! kill -0 $server 2>/dev/null || [ $(( SECONDS - t0 )) -gt 300 ]; then
          echo "$run: the server did not come up:"; tail -30 "$OUT/server_$run.log"; rc=1; break
        fi
        sleep 1
      done
      if grep -q "^ready:" "$OUT/server_$run.log"; then
        grep "^ready:" "$OUT/server_$run.log"
        left=$(( share - (SECONDS - t0) - 45 ))  # 45 s: stopping Serve
        [ "$left" -ge 60 ] || { echo "$run: ${left} s left after the start-up, not enough"; rc=1; }
      fi
      if grep -q "^ready:" "$OUT/server_$run.log" && [ "$left" -ge 60 ]; then
        gpu_ids=$([ "$replicas" = 1 ] && echo 0 || echo 0,1)
        timeout -k 20 $(( left + 30 )) $PY -m higgs_stream.loadgen --url "$url" --time-budget "$left" $load \
          --gpu-index "$gpu_ids" --label "$run" --out "$OUT/loadgen_$run.json" 2>&1 | tee "$OUT/loadgen_$run.log" \
          | grep -v "^\s*$" | tail -12 || rc=1
      fi
      stop_group $server
      tail -3 "$OUT/server_$run.log"
      ;;
    *) echo "unknown run $run (standalone, ray1, ray2)"; rc=1 ;;
  esac
  port=$(( port + 1 ))
done

ls "$OUT"/loadgen_*.json >/dev/null 2>&1 && $PY - "$OUT" <<'EOF' | tee "$OUT/ray_summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {p.stem[len("loadgen_"):]: json.loads(p.read_text()) for p in sorted(out.glob("loadgen_*.json"))}
print("per scenario: ok/busy/err, TTFA p50/p95 ms, streams with an underrun, audio-s per s, requests per replica")
names = sorted({s["name"] for r in runs.values() for s in r["scenarios"]}, key=lambda n: (n[0] != "o", float(n.split("@")[1].rstrip("/s"))))
for name in names:
    print(f"\n{name}")
    for run, r in runs.items():
        s = next((s for s in r["scenarios"] if s["name"] == name), None)
        if s is None:
            print(f"  {run:<11} (not run)")
            continue
        t = s["ttfa_ms"]
        p = lambda v: "-" if v is None else f"{v:.0f}"
        print(f"  {run:<11} {s['completed']}/{s['busy']}/{s['errored']}  TTFA {p(t['p50'])}/{p(t['p95'])}  "
              f"underrun {s['streams_with_underrun']}/{s['streams_with_audio']}  {s['audio_s_per_s'] or 0:.1f} audio-s/s  "
              f"{s.get('replicas') or ''}")
def zero_underrun(r):
    ok = [s["load"] for s in r["scenarios"] if s["kind"] == "closed" and s["streams_with_underrun"] == 0 and s["busy"] == 0
          and s["errored"] == 0 and s["completed"] > 0]
    return max(ok, default=None)
print("\nlargest closed-loop N with zero underruns, no busy, no error:", {run: zero_underrun(r) for run, r in runs.items()})
low = min((s["load"] for r in runs.values() for s in r["scenarios"] if s["kind"] == "open"), default=None)
if low is not None and "standalone" in runs:
    base = next(s for s in runs["standalone"]["scenarios"] if s["kind"] == "open" and s["load"] == low)["ttfa_ms"]
    for run in (r for r in runs if r != "standalone"):
        s = next((s for s in runs[run]["scenarios"] if s["kind"] == "open" and s["load"] == low), None)
        if s and s["ttfa_ms"]["p50"] is not None and base["p50"] is not None:
            print(f"proxy added latency at open@{low:g}/s ({run} - standalone): TTFA p50 "
                  f"{s['ttfa_ms']['p50'] - base['p50']:+.1f} ms, p95 {s['ttfa_ms']['p95'] - base['p95']:+.1f} ms")
EOF
echo "done in ${SECONDS} s"
exit $rc
