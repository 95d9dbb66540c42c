#!/usr/bin/env bash
# The CPU test suite (what CI runs). Sets up .venv first (idempotent), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh webrtc pipecat browser ray
. .venv/bin/activate
# -P: the repo root off the test process's sys.path (python -m puts the working directory first): its top-level
# kernels/ folder shadowed the `kernels` package transformers >= 5.25 imports (ImportError: cannot import name
# 'CUDAProperties' from 'kernels', CI on a fresh clone, 2026-12-03). Not exported: Ray Serve's replicas failed to
# deploy with PYTHONSAFEPATH=1 in their environment
python -P -m pytest -q -m "not gpu" "$@"
