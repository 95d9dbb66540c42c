"""Random-weight models: the released architectures (and the tiny test ones) with seeded random
weights, for benchmarks, parity runs and `higgs-stream serve --model random:tiny|random:full [--arch v2|v3]`.
The output is noise, never speech.

Built in memory, no checkpoint written by the caller:

    random:tiny  the `make-checkpoint --preset tiny` model (seed 0), written to a temporary directory,
                 loaded through the normal loaders (`load_engine`, `load_codec_for`) and deleted;
                 CPU (`Engine`) or CUDA (`--kernels ref`: tiny head_dim 16 has no FlashInfer kernel)
    random:full  the released architecture drawn on the GPU (`in_memory_engine`: the family's
                 `random_talker`, models/<family>/random_weights.py) with the full-size codec decoder
                 (`random_full_codec`, no encoder: no voice cloning); CUDA only (the `ModelRunner`)

Random weights never stop by themselves at a sensible point, so the end-of-stream code is made
unreachable (`suppress_eos`): the EOS rows of the audio head are zeroed (EOS logit exactly 0, the
median of a random head's zero-mean logits) and every request's top-k is capped at 50, so EOS is
never sampled and never the argmax. Every utterance then runs to exactly `--max-frames` frames:
controlled lengths for load tests.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from higgs_stream.engine.engine import Engine, EngineConfig, kv_cache_dtype
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.model_runner import runner_config
from higgs_stream.engine.request import GenerationRequest

log = logging.getLogger(__name__)

PREFIX = "random:"
PRESETS = ("tiny", "full")
EOS_TOP_K = 50  # > 50 of 1026 zero-mean logits above 0: EOS (logit 0) never makes the top 50
WARNING = ("RANDOM WEIGHTS (%s, arch %s): this server produces NOISE, NEVER SPEECH. For benchmarking only: "
           "EOS is suppressed, so every utterance runs to exactly --max-frames frames.")


def random_preset(model: str) -> str | None:
    """"tiny" / "full" for `random:tiny` / `random:full`, None for anything else; ConfigError for `random:<other>`."""
    if not model.startswith(PREFIX):
        return None
    preset = model[len(PREFIX):]
    if preset not in PRESETS:
        raise ConfigError(f"--model {model!r}: expected one of {', '.join(PREFIX + p for p in PRESETS)}")
    return preset


def build_random(model: str, arch: str | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, config: EngineConfig | None = None, cuda_graphs: bool = True,
                 kernels: str = "fast", seed: int = 0, quantize: str = "none",
                 runner_options: Mapping[str, Any] | None = None) -> tuple[Engine, Any]:
    """(engine, codec) for `random:tiny` or `random:full` of the family `arch` (the registry's
    default when None), EOS suppressed. `config`: the engine's EngineConfig (KV pages, max batch);
    the rest as `engine.load_engine`."""
    from higgs_stream.engine.models.registry import DEFAULT_ARCH, family_named

    preset = random_preset(model)
    if preset is None:
        raise ConfigError(f"{model!r} is not a random model ({PREFIX}tiny or {PREFIX}full)")
    arch = arch or DEFAULT_ARCH
    family_named(arch)  # ConfigError for an unknown arch
    config = config or EngineConfig()
    log.warning(WARNING, model, arch)
    t0 = time.perf_counter()
    if preset == "tiny":
        engine, codec = _tiny(arch, device, dtype, config, cuda_graphs, kernels, seed, quantize, runner_options)
    else:
        if torch.device(device).type != "cuda":
            raise ConfigError(f"{model} runs on CUDA only (ModelRunner, ~8 GB of bf16 weights); "
                              f"use {PREFIX}tiny on {device}")
        engine, codec = _full(arch, device, dtype or torch.bfloat16, config, cuda_graphs, kernels, seed, quantize,
                              runner_options)
    log.warning("random %s %s model ready in %.1f s (%s on %s); its output is noise, never speech",
                preset, arch, time.perf_counter() - t0, type(engine).__name__, engine.device)
    return engine, codec


# ---------------------------------------------------------------------------------- builders
def _tiny(arch: str, device: Any, dtype: torch.dtype | None, config: EngineConfig, cuda_graphs: bool,
          kernels: str, seed: int, quantize: str, runner_options: Mapping[str, Any] | None) -> tuple[Engine, Any]:
    from higgs_stream.engine.checkpoint_writer import write_checkpoint
    from higgs_stream.engine.engine import load_engine
    from higgs_stream.engine.models.registry import load_codec_for

    tmp = Path(tempfile.mkdtemp(prefix="higgs-random-tiny-"))
    try:  # everything is read into memory; the directory goes once loaded
        root = write_checkpoint(tmp / arch, arch=arch, preset="tiny", seed=seed)
        engine = load_engine(str(root), device=device, dtype=dtype, config=config, cuda_graphs=cuda_graphs,
                             kernels=kernels, quantize=quantize, runner_options=runner_options)
        codec = load_codec_for(root, device=device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    suppress_eos(engine)
    return engine, codec


def _full(arch: str, device: Any, dtype: torch.dtype, config: EngineConfig, cuda_graphs: bool, kernels: str,
          seed: int, quantize: str, runner_options: Mapping[str, Any] | None) -> tuple[Engine, Any]:
    engine = in_memory_engine(arch, "full", device, dtype, config, cuda_graphs, kernels, seed, quantize=quantize,
                              runner_options=runner_options)
    codec = random_full_codec(seed)
    if codec.geometry.num_codebooks != engine.cfg.num_codebooks:  # random:full builds the Higgs codec only
        raise ConfigError(f"random:full has the Higgs codec ({codec.geometry.num_codebooks} codebooks); --arch {arch} "
                          f"writes {engine.cfg.num_codebooks}: write a checkpoint with make-checkpoint --arch {arch} "
                          f"--preset full and serve that")
    return engine, codec


def in_memory_engine(arch: str, preset: str, device: Any, dtype: torch.dtype, config: EngineConfig,
                     cuda_graphs: bool = True, kernels: str = "fast", seed: int = 0, eos: bool = False,
                     quantize: str = "none", runner_options: Mapping[str, Any] | None = None) -> Engine:
    """An engine with the ModelRunner over a random talker drawn in memory (no files), EOS suppressed unless `eos`.
    `random:full` uses it with preset "full" on CUDA; tests run it with "tiny" on the CPU (kernels="ref").
    `quantize`: none | int8 | fp8 (engine/quantize.py), applied before the runner packs the weights."""
    from higgs_stream.engine.kv_cache import KVCache
    from higgs_stream.engine.models.registry import family_named
    from higgs_stream.engine.quantize import check_supported, quantize_talker

    check_supported(quantize, torch.device(device), dtype, kernels)  # before drawing ~8 GB of weights
    talker, cfg, tokenizer = family_named(arch).random_talker(preset, device, dtype, config.max_seq_len, seed)
    quantize_talker(talker, quantize, kernels)
    if not eos:
        _zero_eos_rows(talker, cfg)  # before the engine takes views of the head (the graphs read it in place)
    cache = KVCache.create(cfg, num_pages=config.kv_pages, page_size=config.page_size,
                           dtype=kv_cache_dtype(config.kv_cache_dtype, talker.dtype), device=device)
    runner = runner_config(quantize, cuda_graphs, kernels, runner_options)
    engine = Engine(talker, cfg, tokenizer, cache, config, runner)
    if not eos:
        suppress_eos(engine)
    return engine


def random_full_codec(seed: int = 0) -> Any:
    """The full-size Higgs codec decoder (random weights, fp32) on the GPU."""
    from higgs_stream.engine.codec.config import CodecConfig

    return random_codec(CodecConfig.full(), seed)


def random_codec(config: Any, seed: int = 0, device: str = "cuda") -> Any:
    """A Higgs codec decoder of `config` (random weights, fp32, codebooks drawn from N(0, 1) so that
    every code decodes to a different vector) on `device`."""
    from higgs_stream.engine.codec.codec import Codec

    torch.manual_seed(seed)
    codec = Codec(config, with_encoder=False)
    with torch.no_grad():
        for name, buf in codec.named_buffers():
            if name.endswith("codebook.embed"):
                buf.normal_()
    return codec.to(device).eval()


# ---------------------------------------------------------------------------------- EOS
@torch.no_grad()
def _zero_eos_rows(talker: torch.nn.Module, cfg: Any) -> None:
    weight = talker.audio_head_weight  # [h * V, H] (h: the head's codebooks), every family's talker names it so
    weight.view(-1, cfg.audio_vocab, weight.shape[-1])[:, cfg.audio_stream_eos_id] = 0  # [h, V, H]


@torch.no_grad()
def suppress_eos(engine: Engine) -> None:
    """Make EOS unreachable (random weights only): zero its audio-head rows, in the talker and in the
    fast path's head (views of the same matrix, zeroed in place so captured graphs see it), and cap
    every request's top-k at EOS_TOP_K (greedy requests are left alone: logit 0 is never the argmax)."""
    cfg = engine.cfg
    _zero_eos_rows(engine.talker, cfg)
    fast = getattr(engine.runner, "fast", None)
    if fast is not None:
        fast.audio_head.view(-1, cfg.audio_vocab, fast.audio_head.shape[-1])[:, cfg.audio_stream_eos_id] = 0
    add = engine.add

    def add_capped(request: GenerationRequest) -> int:
        s = request.sampling
        if not s.greedy and (s.top_k is None or s.top_k > EOS_TOP_K):
            request = replace(request, sampling=replace(s, top_k=EOS_TOP_K))
        return add(request)

    engine.add = add_capped  # type: ignore[method-assign]
