#!/usr/bin/env bash
# The CPU test suite (what CI runs). Sets up .venv first (idempotent), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh webrtc pipecat browser ray
. .venv/bin/activate
python -m pytest -q -m "not gpu" "$@"
