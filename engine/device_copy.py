"""Host -> device uploads that never make the host wait for the device.

`tensor.to(cuda)` (and `torch.tensor(..., device=cuda)`) copies synchronously: the host waits until
everything already queued on the current stream has run, so an engine step that uploads a few
indices would wait for the previous step's forward and lose the overlap of host and device work.
`upload` copies with `non_blocking=True`: from pageable memory the driver stages the bytes before the
call returns (the source may be freed or reused at once) and the device copies them in stream order.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(x, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` (array-like or CPU tensor) as a tensor on `device`, copied in stream order without a host wait."""
    t = torch.as_tensor(np.ascontiguousarray(x) if isinstance(x, np.ndarray) else x, dtype=dtype)
    return t.to(device, non_blocking=True)
