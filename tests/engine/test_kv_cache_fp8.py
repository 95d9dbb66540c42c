"""`EngineConfig(kv_cache_dtype="fp8")` / `--kv-cache-dtype fp8` on the CPU: K/V pages in e4m3
(unscaled, saturating at +-448), written by both runners' stores and read back by the attention.

Measured on the tiny checkpoints (AMD EPYC, torch 2.11), teacher-forced on the fp8-KV engine's greedy
columns against the same engine with fp32 pages: top-64 audio log-prob mean |d| 0.009 nat, p99 0.036 /
0.039, argmax agreement 0.98 / 0.99 (v3 / v2), about what int8 weights cost.
"""

from __future__ import annotations

import pytest
import torch

from higgs_stream.bench_model import compare_logits, end_of_speech_guard, fast_logits, parity_request
from higgs_stream.engine.engine import Engine, EngineConfig, load_engine
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import ModelRunnerConfig
from higgs_stream.engine.random_weights import suppress_eos
from higgs_stream.kernels.attention import FP8_KV, store_rows, to_kv, write_paged_kv_ref
from higgs_stream.kernels.rope_kv import cos_sin_table, rope_store_kv_ref

REF = ModelRunnerConfig(kernels="ref", cuda_graphs=False)
FIXTURE = {"v2": "tiny_ckpt", "v3": "tiny_v3_ckpt"}


def load(request, arch: str, kv: str = "auto", runner=None, quantize: str = "none") -> Engine:
    return Engine.from_pretrained(str(request.getfixturevalue(FIXTURE[arch])), runner=runner, quantize=quantize,
                                  config=EngineConfig(max_batch=4, kv_pages=128, kv_cache_dtype=kv))


def test_fp8_stores_saturate_instead_of_overflowing():
    x = torch.tensor([0.0, 1.0, -3.3, 447.0, 460.0, 500.0, -1e6])
    assert torch.equal(to_kv(x, FP8_KV).float(), torch.tensor([0.0, 1.0, -3.25, 448.0, 448.0, 448.0, -448.0]))
    assert torch.isnan(x.to(FP8_KV).float()).any()  # what a plain cast would have stored
    flat = torch.zeros(6, 2, 4, dtype=FP8_KV)
    vals = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(0)) * 100
    store_rows(flat, torch.tensor([4, 1]), vals)
    assert torch.equal(flat[[4, 1]].float(), to_kv(vals, FP8_KV).float()) and not flat[[0, 2, 3, 5]].float().any()


def test_both_stores_write_the_rounded_fp32_values():
    """write_paged_kv_ref and rope_store_kv_ref into fp8 pools == their fp32 pools rounded (to_kv)."""
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, n = 4, 2, 16, 5
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen) * 30
    pos, slots = torch.tensor([0, 3, 7, 8, 20]), torch.tensor([9, 2, 5, 30, 17])
    cs = cos_sin_table(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 64, "cpu")
    pools = {dt: (torch.zeros(8, 4, hkv, d, dtype=dt), torch.zeros(8, 4, hkv, d, dtype=dt))
             for dt in (torch.float32, FP8_KV)}
    for k, v in pools.values():
        rope_store_kv_ref(qkv, pos, cs, slots, k, v, hq, hkv, d)
    (k32, v32), (k8, v8) = pools[torch.float32], pools[FP8_KV]
    assert torch.equal(k8.float(), to_kv(k32, FP8_KV).float()) and torch.equal(v8.float(), to_kv(v32, FP8_KV).float())
    kk, vv = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
    write_paged_kv_ref(k8, v8, kk, vv, slots)
    assert torch.equal(k8.view(-1, hkv, d)[slots].float(), to_kv(kk, FP8_KV).float())


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_fp8_pages_track_full_precision_pages(request, arch):
    kv8, base = load(request, arch, "fp8", REF), load(request, arch, "auto", REF)
    assert kv8.cache.pool.k.dtype == FP8_KV and base.cache.pool.k.dtype == torch.float32
    assert KVCache.bytes_per_page(kv8.cfg, 16, FP8_KV) * 4 == KVCache.bytes_per_page(kv8.cfg, 16, torch.float32)
    prompt = base.policy.build_prompt(parity_request())
    ours, cols = fast_logits(kv8, prompt, 32)
    ref, _ = fast_logits(base, prompt, 32, cols)
    r = compare_logits(ours, ref)
    assert 1e-4 < r["mean_abs_delta_nat"] < 0.02 and r["p99_abs_delta_nat"] < 0.08 and r["argmax_agreement"] >= 0.95, r


@pytest.mark.parametrize("arch", ["v2", "v3"])
@pytest.mark.parametrize("runner", [None, REF], ids=["ref-runner", "model-runner"])
def test_a_forced_runaway_ends_at_the_cap_with_fp8_pages_and_int8_weights(request, arch, runner):
    eng = load(request, arch, "fp8", runner, quantize="int8")
    suppress_eos(eng)
    res = end_of_speech_guard(eng, n=3, max_frames=24)
    assert res["length"] == 3 and res["length_at_cap"] and res["runaway"] == 0, res
    res = end_of_speech_guard(load(request, arch, "fp8", runner), n=3, max_frames=30, temperature=0.9)
    assert res["all_ended_by_eos_or_cap"] and res["runaway"] == 0, res


def test_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"--kv-cache-dtype fp8 needs compute capability >= 8\.9.*has compute "
                                          r"capability 8\.0"):
        load_engine("/no/such/checkpoint", device="cuda", config=EngineConfig(kv_cache_dtype="fp8"))
