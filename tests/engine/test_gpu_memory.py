"""engine/gpu_memory.py: the serving process's GPU memory bound (its arithmetic and its calls into torch.cuda, with
torch.cuda's memory functions replaced by a fake device; the real bound runs in the GPU tests and the server)."""

from __future__ import annotations

import pytest
import torch

from higgs_stream.engine import gpu_memory
from higgs_stream.engine.gpu_memory import bound_process_memory, memory_fraction, with_plan_headroom

GB = 10**9


def test_memory_fraction():
    assert memory_fraction(24 * GB, 150 * GB, 16 * GB) == pytest.approx(40 / 150)
    assert memory_fraction(140 * GB, 150 * GB, 16 * GB) == 1.0  # never above the device
    for bad in ((0, 0, 1), (-1, 10, 1), (0, 10, 0)):
        with pytest.raises(ValueError):
            memory_fraction(*bad)


class FakeCuda:
    """torch.cuda's memory functions over one device of `total` bytes holding `reserved`."""

    def __init__(self, total: int, reserved: int):
        self.total, self.reserved, self.fractions = total, reserved, []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": self.total}))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: self.reserved)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

        def set_fraction(fraction, device):  # torch takes an indexed device or an int only
            assert isinstance(device, int) or device.index is not None, device
            self.fractions.append(fraction)

        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)


def test_bound_is_what_the_process_holds_plus_the_headroom(monkeypatch):
    fake = FakeCuda(150 * GB, 24 * GB)
    fake.install(monkeypatch)
    assert bound_process_memory("cuda", 16.0) == int(40 / 150 * 150 * GB)  # an unindexed device: the current one
    assert fake.fractions == [pytest.approx(40 / 150)]
    assert bound_process_memory(torch.device("cuda", 0), None) is None  # no headroom: no bound
    assert bound_process_memory("cpu", 16.0) is None
    assert len(fake.fractions) == 1


def test_plan_headroom_grows_until_the_run_fits(monkeypatch):
    fake = FakeCuda(150 * GB, 10 * GB)
    fake.install(monkeypatch)
    calls = []

    def run():  # out of memory under the first bound, fits under the second
        calls.append(fake.fractions[-1])
        if len(calls) == 1:
            raise torch.OutOfMemoryError("fake")
        return "done"

    assert with_plan_headroom("cuda:0", run) == "done"
    h = gpu_memory.PLAN_HEADROOM_GB
    assert calls == [pytest.approx((10 + h[0]) / 150), pytest.approx((10 + h[1]) / 150)]

    def never():
        raise torch.OutOfMemoryError("fake")

    with pytest.raises(torch.OutOfMemoryError):  # the last headroom's failure is the caller's
        with_plan_headroom("cuda:0", never)
