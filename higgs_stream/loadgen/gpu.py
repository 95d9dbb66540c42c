"""GPU busy share during a run, sampled on this host (pynvml, else nvidia-smi; none without a GPU)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time


class GpuMonitor:
    """GPU utilization (% of time a kernel ran) every 200 ms, from pynvml or `nvidia-smi -lms 200`;
    with several GPUs (`index` a tuple: the replicas of a Ray Serve run) each sample is their mean."""

    def __init__(self, index: int | tuple[int, ...] = 0, period_s: float = 0.2) -> None:
        self.samples: list[tuple[float, float]] = []
        self.source: str | None = None
        self._stop = threading.Event()
        self._proc: subprocess.Popen | None = None
        indices = (index,) if isinstance(index, int) else tuple(index)
        reader = self._nvml(indices, period_s) or self._smi(indices, period_s)
        if reader is not None:
            threading.Thread(target=reader, daemon=True, name="gpu-monitor").start()

    def _nvml(self, indices: tuple[int, ...], period_s: float):
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
            for handle in handles:
                pynvml.nvmlDeviceGetUtilizationRates(handle)
        except pynvml.NVMLError:  # no driver or no such GPU: try nvidia-smi
            return None
        self.source = "pynvml"

        def read() -> None:
            while not self._stop.wait(period_s):
                busy = [float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles]
                self.samples.append((time.monotonic(), sum(busy) / len(busy)))
        return read

    def _smi(self, indices: tuple[int, ...], period_s: float):
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
        self._proc = subprocess.Popen([exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                       "-lms", str(int(period_s * 1000)), "-i", ",".join(map(str, indices))],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.source = "nvidia-smi"

        def read() -> None:  # one line per GPU per period, in index order: average each group
            group: list[float] = []
            for line in self._proc.stdout:
                try:
                    group.append(float(line.strip()))
                except ValueError:
                    continue
                if len(group) == len(indices):
                    self.samples.append((time.monotonic(), sum(group) / len(group)))
                    group = []
        return read

    def window(self, t0: float, t1: float) -> list[float] | None:
        """Samples taken in [t0, t1]; None when there is no GPU monitor."""
        if self.source is None:
            return None
        return [v for t, v in list(self.samples) if t0 <= t <= t1]

    def close(self) -> None:
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=5)
