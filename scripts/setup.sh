#!/usr/bin/env bash
# Idempotent environment set-up: a venv in .venv with torch 2.11 (+ torchaudio, which the
# transformers codec reference needs), this package in editable mode and its test extras.
# Usage: scripts/setup.sh [extra ...]   (extras: test, webrtc, pipecat, browser, ray)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
python -c 'import torch, torchaudio; assert torch.__version__.startswith("2.11")' 2>/dev/null \
  || pip_q torch==2.11.0 torchaudio==2.11.0
extras="test"
for e in "$@"; do
  case "$e" in
    browser) need_browser=1; extras="$extras,browser" ;;
    *) extras="$extras,$e" ;;
  esac
done
pip_q -e ".[${extras}]"
python -c 'import higgs_stream.engine' # the editable install must import
if [ "${need_browser:-0}" = 1 ]; then
  if [ ! -x /usr/bin/chromium ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
      || echo "warning: could not install Debian's chromium; browser tests will be skipped" >&2
  fi
fi
