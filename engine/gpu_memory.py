"""A bound on a serving process's GPU memory: what it holds now plus a headroom.

Why a server needs one even when it has the device to itself: PyTorch's cuDNN convolutions (heuristic
mode, `torch.backends.cudnn.benchmark` off) run the first execution plan whose workspace the caching
allocator can hand out, and they ask for up to the device's free memory. Measured on an idle H200 (torch
2.11, cuDNN 9.19, session 18, `scripts/codec_capture_memory.py`): for one convolution of the Qwen3-TTS
12 Hz decoder at 16 streams x 2 frames ([16, 768, 70] * [768, 768, 7]) that plan took ~80 GB of workspace
and returned wrong sums (max |d| 1.48 of the output's peak against PyTorch's native convolution); the
stateful decoder's CUDA graphs failed their check at that bucket and a served Qwen3-TTS 1.7B ran out of
memory while capturing them (110 GB in graph pools). Where an allocation that large fails (an H100's
80 GB, or this bound) PyTorch halves the ask and drops the plans that need more, and the same
convolution is right (2e-6, the fp32 rounding of the native one). cuDNN's workspace cap
(`CUDNN_CONV_WSCAP_DBG`) and `cudnn.deterministic` changed neither the plan nor its result there.

A plan's first call allocates the largest workspace it can get (halving from the plan list's largest until
an allocation succeeds) and keeps the first plan that fits it, so under any bound the plans take most of
what is free, and a CUDA graph captured from them keeps those workspaces in its pool: with 16 and with 48 GB
of headroom the Qwen3-TTS codec's graphs took it all (12 and 35 GB of pools) and the next activation failed
(H200). So the codec's warm-up first runs one eager step at every bucket shape with a small headroom
(PLAN_HEADROOM_GB: the plans are picked and cached there, each with a small workspace), then captures the
graphs with WARMUP_HEADROOM_GB (the cached plans are reused: only their own workspaces enter the pools),
then the process is capped at what it holds plus the runtime headroom (HEADROOM_GB by default): no
convolution can take a workspace larger than these, and the codec's graph pools no longer grow with the
card (the Higgs v2 codec's held 48.5 GB after the warm-up on the H200 without a
bound, 132 GB during it). Runtime allocations beyond the bound (an eager step's activations, a reference
clip's encode) raise torch.OutOfMemoryError, which fails that request: the headroom must hold them. Behind
the bound, the codec worker checks its graphs against PyTorch's native convolutions at start-up and decodes with
cuDNN off where a plan still disagrees (stream/codec_worker.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
T = TypeVar("T")

HEADROOM_GB = 16.0  # default: room for eager activations and workspaces above what the process holds
PLAN_HEADROOM_GB = (8.0, 16.0, 32.0)  # while convolutions pick their plans: the first that holds the step's activations
WARMUP_HEADROOM_GB = 48.0  # while the codec captures its graphs (< the ~80 GB of the wrong plan)


def memory_fraction(reserved: int, total: int, headroom: int) -> float:
    """The share of a device of `total` bytes that lets a process holding `reserved` bytes grow by `headroom`."""
    if total <= 0 or reserved < 0 or headroom <= 0:
        raise ValueError(f"need total > 0, reserved >= 0, headroom > 0; got {total}, {reserved}, {headroom}")
    return min(1.0, (reserved + headroom) / total)


def with_plan_headroom(device, run: Callable[[], T]) -> T:
    """`run()` with the process bounded at each PLAN_HEADROOM_GB in turn until it does not run out of memory
    (convolutions that finished keep their plans); CUDA only."""
    import torch

    for i, headroom in enumerate(PLAN_HEADROOM_GB):
        bound_process_memory(device, headroom)
        try:
            return run()
        except torch.OutOfMemoryError:
            if i + 1 == len(PLAN_HEADROOM_GB):
                raise
            torch.cuda.empty_cache()
            log.warning("out of GPU memory with %.0f GB of headroom while picking convolution plans; trying %.0f",
                        headroom, PLAN_HEADROOM_GB[i + 1])
    raise AssertionError("unreachable")


def bound_process_memory(device: torch.device | str | None, headroom_gb: float | None) -> int | None:
    """Cap PyTorch's caching allocator on `device` at the bytes it holds now plus `headroom_gb` GB. Returns
    the cap in bytes; None (and no cap) on a device that is not CUDA or with `headroom_gb` None."""
    import torch  # here: stream/config.py reads HEADROOM_GB without importing torch

    if headroom_gb is None or device is None or torch.device(device).type != "cuda":
        return None
    device = torch.device(device)
    if device.index is None:  # set_per_process_memory_fraction takes an indexed device only
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    reserved = torch.cuda.memory_reserved(device)
    fraction = memory_fraction(reserved, total, int(headroom_gb * 1e9))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    cap = int(fraction * total)
    log.info("GPU memory of this process capped at %.1f GB of %.1f (%.1f GB held + %.1f GB headroom)",
             cap / 1e9, total / 1e9, reserved / 1e9, headroom_gb)
    return cap
