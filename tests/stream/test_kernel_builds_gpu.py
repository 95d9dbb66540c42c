"""Kernels built while serving, on a GPU (stream/kernel_builds.py): a real Triton kernel's first launch with each
set of constexprs is one build, reported with its name and time; a second launch with the same ones is none."""

from __future__ import annotations

import pytest
import torch
from higgs_stream.stream.kernel_builds import BuildWatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _scale_kernel(x_ptr, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i) * SCALE)


def test_each_new_specialization_of_a_triton_kernel_is_one_build():
    builds: list[tuple] = []
    watch = BuildWatch(lambda kind, name, start, seconds: builds.append((kind, name, seconds)))
    x = torch.ones(64, device="cuda")
    try:
        _scale_kernel[(1,)](x, SCALE=3, BLOCK=64)
        _scale_kernel[(1,)](x, SCALE=3, BLOCK=64)  # built already: none
        _scale_kernel[(1,)](x, SCALE=2, BLOCK=64)
    finally:
        watch.close()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 18.0))
    assert [k for k, _, _ in builds] == ["triton", "triton"]
    assert builds[0][1].startswith("_scale_kernel[") and "SCALE=3" in builds[0][1] and "BLOCK=64" in builds[0][1]
    assert "SCALE=2" in builds[1][1]
    assert all(s > 0 for _, _, s in builds)
