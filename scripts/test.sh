#!/usr/bin/env bash
# The CPU test suite (what CI runs). Sets up .venv first (idempotent), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh webrtc pipecat browser ray
. .venv/bin/activate
# The repo root must not be on sys.path (python -m puts the working directory first, and the test subprocesses
# inherit this): its top-level kernels/ folder would shadow the `kernels` package transformers >= 5.25 imports
# (ImportError: cannot import name 'CUDAProperties' from 'kernels', CI on a fresh clone, 2026-12-03)
export PYTHONSAFEPATH=1
python -m pytest -q -m "not gpu" "$@"
