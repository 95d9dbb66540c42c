"""CPU-side checks of the FlashInfer wrapper (the GPU comparisons are in *_gpu.py)."""

import pytest
import torch


def test_head_dims_without_a_flashinfer_kernel_are_refused_by_name():
    """Runs on CPU too: the check happens before any FlashInfer call (tiny presets use head_dim 16)."""
    from higgs_stream.kernels._triton import KernelUnavailableError
    from higgs_stream.kernels.flashinfer_attention import check_head_dim

    for ok in (64, 128, 256):
        check_head_dim(ok)
    with pytest.raises(KernelUnavailableError, match=r"supports head_dim \(64, 128, 256\), this model has 16"):
        check_head_dim(16)


def test_host_csr_is_the_page_layout_flashinfer_reads():
    """HostCSR.build (on every decode step): per sequence, its first ceil(kv_len / page_size) pages in
    order, CSR offsets of pages and of query rows, the fill of each last page; int32 host tensors."""
    import numpy as np

    from higgs_stream.kernels.flashinfer_attention import HostCSR

    rng = np.random.default_rng(0)
    kv_lens = [1, 16, 17, 300, 33, 5]
    qo_lens = [1, 1, 17, 1, 33, 2]
    tables = [list(map(int, rng.integers(0, 1000, size=(k + 15) // 16 + extra))) for k, extra in zip(kv_lens, (0, 2, 0, 1, 3, 0))]
    csr = HostCSR.build(tables, kv_lens, qo_lens, 16)
    pages = [(k + 15) // 16 for k in kv_lens]
    assert csr.kv_indptr.tolist() == [0, *np.cumsum(pages).tolist()]
    assert csr.qo_indptr.tolist() == [0, *np.cumsum(qo_lens).tolist()]
    assert csr.kv_indices.tolist() == [p for t, n in zip(tables, pages) for p in t[:n]]
    assert csr.kv_last_page_len.tolist() == [1, 16, 1, 12, 1, 5]
    assert {t.dtype for t in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_last_page_len)} == {torch.int32}
    assert csr.batch_size == 6 and csr.num_tokens == sum(qo_lens)
    empty = HostCSR.build([], [], [], 16)
    assert empty.batch_size == 0 and empty.kv_indptr.tolist() == [0] and empty.kv_indices.numel() == 0
    with pytest.raises(AssertionError, match="too short"):
        HostCSR.build([[1]], [17], [1], 16)
    with pytest.raises(AssertionError, match="qo_len"):
        HostCSR.build([[1]], [4], [5], 16)
