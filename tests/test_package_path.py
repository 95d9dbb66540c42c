"""higgs_stream/__init__.py: importing the package from a checkout takes the checkout's root off sys.path, so its
top-level folders (kernels/ above all: transformers >= 5.25 imports Hugging Face's `kernels` package) never shadow
installed packages, from `python -m` in the root as from Ray Serve's workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import higgs_stream

ROOT = Path(__file__).resolve().parents[1]


def test_the_checkout_is_the_source_root():
    assert higgs_stream._source_root() == str(ROOT)


def test_only_the_root_leaves_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    link = tmp_path / "link"
    link.symlink_to(ROOT)
    path = ["", str(ROOT), str(ROOT) + "/", str(link), str(ROOT / "tests"), "/usr/lib/python3", str(tmp_path)]
    higgs_stream._unshadow(path, str(ROOT))
    assert path == [str(ROOT / "tests"), "/usr/lib/python3", str(tmp_path)]


def test_nothing_leaves_the_path_for_an_installed_package():
    path = ["", str(ROOT), "/usr/lib/python3"]
    higgs_stream._unshadow(path, None)
    assert path == ["", str(ROOT), "/usr/lib/python3"]


def test_kernels_is_not_the_checkouts_folder_after_import():
    """`python -c` from the root puts the working directory first on sys.path, as `python -m` does."""
    probe = ("import importlib.util, sys, higgs_stream; spec = importlib.util.find_spec('kernels'); "
             "print(spec.origin if spec else None); print(any(p in ('', sys.argv[1]) for p in sys.path))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", probe, str(ROOT)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")
    origin, root_on_path = out[0], out[1]
    assert origin == "None" or not Path(origin).resolve().is_relative_to(ROOT / "kernels"), origin
    assert root_on_path == "False"
