"""The benchmark's model: the full-size Higgs v2 talker with random weights (drawn from transformers'
reference, which the parity section compares against), its engine, and the utterance every stream says."""

from __future__ import annotations

import time
from typing import Any

import torch

from higgs_stream.bench.measure import log
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.model_runner import runner_config
from higgs_stream.engine.models.higgs_v2.random_weights import (
    random_reference,
    talker_from_reference,
    tokenizer_and_config,
)
from higgs_stream.engine.quantize import quantize_talker
from higgs_stream.engine.random_weights import EOS_TOP_K

TEXT = ("The quick brown fox jumps over the lazy dog while the morning train rolls into the station, "
        "and she said good morning, how are you today, before the whole sentence had been spoken.")
FRAMES = 250  # 10 s at 25 frames/s
TOP_K = EOS_TOP_K  # with the EOS rows of the random audio head zeroed, EOS (logit 0) never makes the top 50


def engine_config(kv_pages: int) -> EngineConfig:
    """Every family's engine in the benchmark: up to 256 streams, 16-token pages."""
    return EngineConfig(max_batch=256, token_budget=4096, max_waiting=1024, max_seq_len=4096,
                        kv_pages=kv_pages, page_size=16)


def random_v2(quantize: str) -> tuple[Any, Any, torch.nn.Module, Any]:
    """(tokenizer, config, fp32 transformers reference, bf16 talker drawn from it, quantized), on the GPU."""
    tok, cfg = tokenizer_and_config("full")
    t0 = time.perf_counter()
    hf = random_reference(cfg, "cuda")
    talker = talker_from_reference(hf, cfg, torch.bfloat16)
    quantize_talker(talker, quantize)
    log(f"random full-size model built in {time.perf_counter() - t0:.1f} s (quantize {quantize})")
    return tok, cfg, hf, talker


def v2_engine(talker: Any, cfg: Any, tok: Any, config: EngineConfig, cuda_graphs: bool, quantize: str = "none",
              runner_options: dict | None = None) -> tuple[Engine, float]:
    """The talker's (quantized with `quantize`) engine on a bf16 K/V pool of `config.kv_pages` pages, with `serve`'s
    runner configuration (`runner_config`; `runner_options` over it), and the seconds its build (graph capture)
    took."""
    cache = KVCache.create(cfg, num_pages=config.kv_pages, page_size=16, dtype=torch.bfloat16, device="cuda")
    t0 = time.perf_counter()
    engine = Engine(talker, cfg, tok, cache, config, runner_config(quantize, cuda_graphs, options=runner_options))
    return engine, time.perf_counter() - t0
