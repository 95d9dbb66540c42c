#!/usr/bin/env bash
# Wheels for the Qwen3-TTS reference bench on the GPU machine (no network there), into .whl_qref/
# (in .gitignore): the official PyPI `qwen-tts` 0.1.1 and the pins it runs under (transformers 4.57.3;
# the machine has 5.x, so these go to a --target folder that is put FIRST on PYTHONPATH, only in the
# subprocess that runs scripts/qwen3_reference_bench.py; see `REF=1` in scripts/gpu_qwen3.sh).
#
# What the machine's image already has (../.library/device/KINDS.md) is not carried: torch, numpy,
# safetensors, regex, requests, pyyaml, tqdm, filelock, fsspec, packaging, typing-extensions, hf-xet,
# psutil (huggingface_hub 0.36's and transformers 4.57's other needs), onnxruntime and torchaudio
# (imported by qwen_tts's 25 Hz tokenizer module at import time). librosa, soundfile and sox (audio
# I/O and the speaker encoder's mel filterbank, none of them on the generation path) are not carried:
# the bench puts stub modules in their place (librosa alone would bring numba's stack).
# qwen-tts is fetched with --no-deps (gradio: its web demo only).
#
# Usage: bash scripts/qwen3_ref_wheels.sh            (PYVER=3.12 OUT_DIR=.whl_qref by default)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PYVER=${PYVER:-3.12}
OUT_DIR=${OUT_DIR:-.whl_qref}
mkdir -p "$OUT_DIR"
get() {
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$OUT_DIR" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
get transformers==4.57.3 tokenizers==0.22.2 huggingface_hub==0.36.2 accelerate==1.12.0 einops==0.8.2 \
  qwen-tts==0.1.1
n=$(ls "$OUT_DIR"/*.whl | wc -l)
[ "$n" -eq 6 ] || { echo "expected 6 wheels in $OUT_DIR, found $n" >&2; ls "$OUT_DIR" >&2; exit 1; }
ls -1 "$OUT_DIR"
echo "$OUT_DIR: $n wheels, $(du -cb "$OUT_DIR"/*.whl | tail -1 | awk '{printf "%.1f MB", $1 / 1e6}')"
