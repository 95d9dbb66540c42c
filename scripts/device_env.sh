# Sourced by the device scripts (gpu_bench.sh, gpu_check.sh): $OUT, the carried FlashInfer wheels
# (.whl, from ../shared/device/wheels.sh) and an importable higgs_stream on a machine with no network.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
shim_tree() {  # shim_tree TREE DEST: DEST/higgs_stream, a package whose sub-packages are TREE's top-level
  # folders and the entries of TREE/higgs_stream (its modules and its bench/, loadgen/ packages); for this
  # tree when the editable install fails, for a `git archive` of an older commit in the A/B scripts
  local tree dest=$2 d f
  tree=$(cd "$1" && pwd)
  rm -rf "$dest" && mkdir -p "$dest/higgs_stream"
  for d in engine kernels stream clients; do ln -sfn "$tree/$d" "$dest/higgs_stream/$d"; done
  for f in "$tree"/higgs_stream/*; do ln -sfn "$f" "$dest/higgs_stream/"; done
}
use_baseline() {  # use_baseline TREE: from now on `import higgs_stream` is TREE's (the A/B scripts' baseline run,
  # after this tree's): the editable install goes (its finder wins over PYTHONPATH), a shim goes first on
  # PYTHONPATH. Run Python from /tmp then: from the repo root its own higgs_stream/ folder would be imported.
  python3 -m pip uninstall -y higgs-stream >/dev/null 2>&1
  shim_tree "$1" /tmp/shim_base
  export PYTHONPATH=/tmp/shim_base:${PYTHONPATH:-}
}
if ! python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
  shim_tree . /tmp/shim
  export PYTHONPATH=/tmp/shim:$PYTHONPATH
fi
