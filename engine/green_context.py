"""A CUDA stream confined to some of the GPU's SMs (a CUDA green context, torch.cuda.green_contexts).

Kernels launched on it, and CUDA graphs captured on it, run on at most `num_sms` SMs; other streams
keep every SM. The serving pipeline can give the codec such a stream so its large convolutions never
occupy the whole GPU while the talker's decode step (hundreds of short, bandwidth-bound kernels) waits
for SMs to free up (`serve --codec-sms N`). Hopper rounds the count up to a multiple of 8.
"""

from __future__ import annotations

import torch

from higgs_stream.engine.errors import ConfigError


def green_stream(device: torch.device, num_sms: int) -> torch.cuda.Stream:
    """A new stream on a green context of `num_sms` SMs of `device` (ConfigError when this torch build
    or device cannot make one). The context lives as long as the returned stream object."""
    from torch.cuda import green_contexts

    total = torch.cuda.get_device_properties(device).multi_processor_count
    if not 1 <= num_sms < total:
        raise ConfigError(f"a green context needs 1..{total - 1} of this GPU's {total} SMs, got {num_sms}")
    if not green_contexts.SUPPORTED:
        raise ConfigError("this torch build has no CUDA green contexts (torch.cuda.green_contexts.SUPPORTED is False)")
    try:
        ctx = green_contexts.GreenContext.create(num_sms, torch.device(device).index or 0)
        raw = ctx.Stream()
    except RuntimeError as exc:
        raise ConfigError(f"could not create a green context of {num_sms} SMs: {exc}") from exc
    stream = torch.cuda.Stream(stream_id=raw.stream_id, device_index=raw.device_index, device_type=raw.device_type)
    stream.green_context = ctx  # the context must outlive every launch on the stream
    return stream
