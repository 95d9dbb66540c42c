#!/usr/bin/env bash
# The CPU test suite (what CI runs). Sets up .venv first (idempotent), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh webrtc pipecat browser ray
. .venv/bin/activate
# -P: the repo root off the test process's sys.path from the start (python -m puts the working directory first, and
# its top-level kernels/ shadows the `kernels` package transformers >= 5.25 imports); importing higgs_stream drops it
# too (higgs_stream/__init__.py), as in Ray Serve's workers. Not PYTHONSAFEPATH: Ray's replicas fail to deploy with it
python -P -m pytest -q -m "not gpu" "$@"
