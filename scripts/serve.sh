#!/usr/bin/env bash
# Start the streaming server. MODEL defaults to the Higgs Audio v2 hub repo; pass a local
# checkpoint directory (e.g. one written by `higgs-stream make-checkpoint`) on machines without
# hub access. Extra arguments go to `higgs-stream serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh webrtc
. .venv/bin/activate
MODEL=${1:-bosonai/higgs-audio-v2-generation-3B-base}
shift || true
exec higgs-stream serve --model "$MODEL" "$@"
