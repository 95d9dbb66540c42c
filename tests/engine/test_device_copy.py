"""engine/device_copy.upload: the values arrive; on CUDA the host does not wait for queued work."""

import numpy as np
import pytest
import torch
from higgs_stream.engine.device_copy import upload


def test_upload_keeps_values_and_dtypes_on_cpu():
    a = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]  # non-contiguous
    t = upload(a, "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [[0, 2], [4, 6], [8, 10]]
    assert upload([1.5, 2.0], "cpu", torch.float32).tolist() == [1.5, 2.0]
    assert upload([True, False], "cpu", torch.bool).tolist() == [True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_upload_does_not_wait_for_queued_device_work():
    """A ~0.2 s spin kernel is queued first: a synchronous copy would return after it; upload returns
    while it still runs, and the data is right once the stream reaches the copy."""
    torch.cuda.synchronize()
    src = np.arange(1000, dtype=np.int64)
    torch.cuda._sleep(int(3e8))  # cycles: ~0.2 s at ~1.5-2 GHz
    t = upload(src, "cuda")
    pending = torch.cuda.Event()
    pending.record()
    assert not pending.query(), "upload waited for the queued kernel"
    src[:] = -1  # the driver staged the bytes before upload returned
    torch.cuda.synchronize()
    assert t.cpu().tolist() == list(range(1000))
