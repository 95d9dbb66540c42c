#!/usr/bin/env bash
# Start the streaming server. MODEL defaults to the Higgs Audio v2 hub repo; pass a local
# checkpoint directory (e.g. one written by `higgs-stream make-checkpoint`) on machines without
# hub access. Extra arguments go to `higgs-stream serve`.
# Installs what serving needs: the package (WebSocket, HTTP, the demo), the webrtc extra (aiortc),
# and on a machine with an NVIDIA GPU the gpu extra (FlashInfer, which the default --kernels fast
# path needs on CUDA). setup.sh also installs the small test extra (pytest, scipy, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=(webrtc)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extras+=(gpu)
fi
scripts/setup.sh "${extras[@]}"
. .venv/bin/activate
MODEL=${1:-bosonai/higgs-audio-v2-generation-3B-base}
shift || true
exec higgs-stream serve --model "$MODEL" "$@"
