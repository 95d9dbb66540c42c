#!/usr/bin/env bash
# The Qwen3-TTS reference environment: PyPI `qwen-tts` 0.1.1 (official) pins transformers 4.57.3,
# while this project needs transformers 5.x, so the reference lives in its own venv
# (default .qwen-ref-venv/, git-ignored). Only scripts/qwen3_reference_fixtures.py runs in it; the
# test suite compares against the fixtures that script writes and never needs this venv.
#
# torch 2.11 + torchaudio 2.11: reused from the project's .venv when it has them (a .pth line, as
# the worktree venvs do; saves a ~3 GB download), else installed from PyPI.
# Usage: scripts/qwen3_reference_venv.sh            (idempotent; prints the venv's python)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${QWEN_REF_VENV:-.qwen-ref-venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' || true; }

site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if ! "$VENV/bin/python" -c 'import torch, torchaudio; assert torch.__version__.startswith("2.11")' 2>/dev/null; then
  torch_site=$( [ -x .venv/bin/python ] && .venv/bin/python -c '
import os, torch, torchaudio
assert torch.__version__.startswith("2.11") and torchaudio.__version__.startswith("2.11")
print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null || true)
  if [ -n "$torch_site" ]; then
    echo "$torch_site" > "$site/_project_torch.pth"  # appended after the venv's own site: its pins win
  else
    pip_q torch==2.11.0 torchaudio==2.11.0
  fi
fi
# The reference's own pins; --no-deps for qwen-tts leaves out gradio (its web demo only).
pip_q transformers==4.57.3 accelerate==1.12.0 einops librosa soundfile sox onnxruntime safetensors
pip_q --no-deps qwen-tts==0.1.1
"$VENV/bin/python" -c '
import torch, transformers, qwen_tts
assert transformers.__version__ == "4.57.3", transformers.__version__
print(f"torch {torch.__version__}, transformers {transformers.__version__}, qwen-tts ok")' >&2
echo "$VENV/bin/python"
