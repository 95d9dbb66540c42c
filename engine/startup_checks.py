"""Checks a command makes of its arguments before it loads a model (`serve`, `synth`): each mistake is one ConfigError
(the CLI prints it, exit code 2) instead of a traceback, some of them after the model had loaded (found by probes)."""

from __future__ import annotations

import os

from higgs_stream.engine.errors import ConfigError


def check_device(name: str) -> None:
    """ConfigError unless `name` is a device this machine has: cpu, or cuda[:N] with N < its GPU count (an unknown
    name, a GPU index past the last, CUDA without a GPU were tracebacks before the model loaded, a probe)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConfigError(f"--device {name!r} is not a device: use cpu or cuda[:N]") from e
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r}: this runs on cpu or cuda[:N]")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {name!r}: this machine has no CUDA GPU (use --device cpu)")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {name!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")


def check_output_path(flag: str, path: str | None) -> None:
    """ConfigError unless `path`'s folder exists and is writable: a --trace-out in a missing folder lost the whole
    run's trace at shutdown, with a traceback (a probe)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist or is not writable")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a folder; name a file")
