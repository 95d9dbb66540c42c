# Sourced by the device scripts (gpu_bench.sh, gpu_check.sh): $OUT, the carried FlashInfer wheels
# (.whl, from ../shared/device/wheels.sh) and an importable higgs_stream on a machine with no network.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
  # shim: a higgs_stream package whose sub-packages are the top-level folders
  mkdir -p /tmp/shim/higgs_stream
  for d in engine kernels stream clients; do ln -sfn "$PWD/$d" /tmp/shim/higgs_stream/$d; done
  for f in higgs_stream/*.py; do ln -sf "$PWD/$f" /tmp/shim/higgs_stream/; done
  export PYTHONPATH=/tmp/shim:$PYTHONPATH
fi
