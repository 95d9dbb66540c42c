"""The code predictor's frame attention on CUDA in bf16 at the 1.7B predictor's shape (16 query heads,
8 K/V heads, head_dim 128): SDPA's flash kernel serves the shared-head call (else the math fallback
would copy the heads itself), and equals attention over copied heads."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from higgs_stream.engine.models.qwen3_tts.fast_predictor import FrameAttention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("t,s", [(2, 2), (1, 9), (1, 16)])
def test_flash_serves_shared_heads(t, s, copied_heads):
    b, hq, hkv, d = 8, 16, 8, 128
    q = torch.randn(b * t, hq, d, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, 16, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    attn = FrameAttention(t, s, hq, hkv, d)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot take the call
        got = attn.run(q, k_cache, v_cache)
    want = copied_heads(q.float(), k_cache.float(), v_cache.float(), t, s, hq, hkv, d)
    assert (got.float() - want).abs().max().item() < 3e-2  # bf16 inputs and output, O(1) values
