"""higgs-stream: real-time streaming TTS for Higgs Audio."""
import os as _os
import sys as _sys

__version__ = "0.1.0"


def _source_root() -> str | None:
    """The checkout this package runs from, or None for an installed wheel: in a checkout the sub-packages are the
    root's own folders (`higgs_stream.kernels` is `kernels/`, pyproject's package-dir)."""
    root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    return root if _os.path.isfile(_os.path.join(root, "kernels", "__init__.py")) else None


def _unshadow(path: list[str], root: str | None) -> None:
    """Drop the checkout's root from `path` (sys.path): there its folders import as top-level modules, and its
    `kernels/` shadows Hugging Face's `kernels` package, which transformers >= 5.25 imports (`python -m` from the root
    puts it first; Ray Serve's workers add the driver's working directory). Nothing here imports them top-level."""
    if root is not None:
        path[:] = [p for p in path if _os.path.realpath(p or _os.curdir) != root]


_unshadow(_sys.path, _source_root())
