"""The server under test: its /healthz, and `--spawn`: start a server command, wait until it is
healthy, stop it afterwards."""

from __future__ import annotations

import contextlib
import http.client
import json
import shlex
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from higgs_stream.loadgen.report import log


def http_base(url: str) -> str:
    """ws://host:port/path -> http://host:port (wss -> https)."""
    scheme, _, rest = url.partition("://")
    return ("https" if scheme == "wss" else "http") + "://" + rest.split("/", 1)[0]


def healthz(url: str, timeout_s: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(http_base(url) + "/healthz", timeout=timeout_s) as r:
            return json.loads(r.read())
    except (OSError, ValueError, http.client.HTTPException):  # not up (yet)
        return None


@contextlib.contextmanager
def spawned_server(command: str, url: str, log_path: Path, timeout_s: float) -> Iterator[subprocess.Popen]:
    """`--spawn "higgs-stream serve ..."`: start it, wait for /healthz, yield, stop it (SIGINT, then harder)."""
    log(f"starting the server: {command} (log: {log_path})")
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(shlex.split(command), stdout=out, stderr=subprocess.STDOUT)
        try:
            t0 = time.monotonic()
            while healthz(url) is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy:\n"
                                       + _tail(log_path))
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"the server was not healthy after {timeout_s:.0f} s:\n" + _tail(log_path))
                time.sleep(0.5)
            log(f"server healthy after {time.monotonic() - t0:.1f} s")
            yield proc
        finally:
            for sig, wait_s in ((signal.SIGINT, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                if proc.poll() is not None:
                    break
                proc.send_signal(sig)
                try:
                    proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    continue


def _tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
