"""Imports point downward only: clients -> stream -> engine -> kernels (the package's top-level modules, the CLI,
benchmarks and load generator, sit above all four). Checked on the source text, so an import inside a function counts
as much as one at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "engine", "stream", "clients")  # each may import the ones before it, never the ones after


def imported_layers(path: Path, layer: str) -> list[tuple[int, str]]:
    """(line, layer) for every import in `path` (a module of `layer`) that names one of the LAYERS, absolute
    (`higgs_stream.stream...`) or relative (`from ..stream import x`)."""
    depth = len(path.relative_to(ROOT / layer).parts)  # 1 for a module directly in the layer's folder
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.ImportFrom):  # relative: resolve it against the module's package path
            package = [layer, *path.relative_to(ROOT / layer).parts[:-1]]
            up = node.level - 1
            if up >= depth:  # beyond the layer's folder: into the package root
                base = (node.module or "").split(".") if node.module else [a.name for a in node.names]
                names = [f"higgs_stream.{base[0]}"]
            else:
                names = [f"higgs_stream.{package[0]}"]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "higgs_stream" and len(parts) > 1 and parts[1] in LAYERS:
                out.append((node.lineno, parts[1]))
    return out


def test_every_import_points_down_the_layers():
    wrong = []
    for rank, layer in enumerate(LAYERS):
        files = sorted((ROOT / layer).rglob("*.py"))
        assert files, f"no modules under {layer}/"
        for path in files:
            for line, target in imported_layers(path, layer):
                if LAYERS.index(target) > rank:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "imports that point up the layers:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import_absolute_relative_and_inside_a_function(tmp_path, monkeypatch):
    """The checker itself: a kernel module's imports of the engine (absolute, relative) and of the stream layer
    (inside a function) are all seen, as is one of its own layer (allowed)."""
    import sys

    module = sys.modules[__name__]
    fake = tmp_path / "kernels"
    fake.mkdir()
    bad = fake / "bad.py"
    bad.write_text("from higgs_stream.engine.errors import ConfigError\n"
                   "from ..engine import errors\n"
                   "def f():\n    import higgs_stream.stream.config\n"
                   "from higgs_stream.kernels import norm\n")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    assert sorted(imported_layers(bad, "kernels")) == [(1, "engine"), (2, "engine"), (4, "stream"), (5, "kernels")]
