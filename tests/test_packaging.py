"""The installable package: a wheel built from this tree holds every module of the source tree under
its `higgs_stream` name (an explicit package list once left out a whole model family: `pip install .`
had no Qwen3-TTS while the editable install the tests use had it) and the browser demo's files."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def source_modules() -> set[str]:
    """Every .py file of the packages' source folders, as its path inside the wheel."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = set()
    for name, folder in mapping.items():
        if name.count(".") > 1:
            continue
        for py in (ROOT / folder).rglob("*.py"):
            rel = py.relative_to(ROOT / folder)
            if "__pycache__" not in rel.parts:
                out.add("/".join([*name.split("."), *rel.parts]))
    return out


def test_the_wheel_holds_every_module_and_the_demo(tmp_path):
    """Built from a fresh copy of the tree: setuptools' build/ folder would carry stale modules in."""
    src = tmp_path / "src"
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in set(mapping.values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path), str(src)], capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, f"pip wheel failed (the test extra installs setuptools and wheel): {built.stderr[-2000:]}"
    (wheel,) = tmp_path.glob("higgs_stream-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = source_modules()
    assert "higgs_stream/engine/models/qwen3_tts/codec/streaming.py" in want  # the walk sees nested families
    missing = sorted(want - names)
    assert not missing, f"the wheel lacks {len(missing)} modules, e.g. {missing[:5]} (pyproject's packages list)"
    assert "higgs_stream/clients/web/index.html" in names
