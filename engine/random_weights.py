"""Random-weight models: the released architectures (and the tiny test ones) with seeded random
weights, for benchmarks, parity runs and `higgs-stream serve --model random:tiny|random:full [--arch v2|v3]`.
The output is noise, never speech.

Built in memory, no checkpoint written by the caller:

    random:tiny  the `make-checkpoint --preset tiny` model (seed 0), written to a temporary directory,
                 loaded through the normal loaders (`load_engine`, `load_codec_for`) and deleted;
                 CPU (`Engine`) or CUDA (`--kernels ref`: tiny head_dim 16 has no FlashInfer kernel)
    random:full  the released architecture drawn on the GPU (`in_memory_engine`; v2:
                 random_reference -> talker_from_reference; v3: a TalkerV3 filled like
                 make_checkpoint_v3 draws it) with the full-size codec decoder (`random_full_codec`, no
                 encoder: no voice cloning); CUDA only (`GpuEngine`)

v2 weights: transformers' reference `HiggsAudioV2ForConditionalGeneration` is built on the device in
fp32 and given seeded random weights the way `make-checkpoint` draws them (matrices and embeddings
N(0, 0.02^2), norms 1 + N(0, 0.1^2)) (`random_reference`); our `Talker` is built empty on the same
device and loads those tensors in the serving dtype (`talker_from_reference`). Same bytes and FLOPs
as the released model.

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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from higgs_stream.engine.config import TalkerConfig
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.make_checkpoint import build_text_tokenizer, talker_config
from higgs_stream.engine.request import GenerationRequest
from higgs_stream.engine.talker import Talker
from higgs_stream.engine.tokenizer import TextTokenizer
from higgs_stream.kernels.rope import llama3_inv_freq

log = logging.getLogger(__name__)

PREFIX = "random:"
PRESETS = ("tiny", "full")
ARCHS = ("v2", "v3")
EOS_TOP_K = 50  # > 50 of 1026 zero-mean logits above 0: EOS (logit 0) never makes the top 50
BPE_VOCAB = {"full": 128000, "tiny": 512}
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


def build_random(model: str, arch: str = "v2", device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 config: EngineConfig | None = None, cuda_graphs: bool = True, kernels: str = "fast",
                 seed: int = 0) -> tuple[Engine, Any]:
    """(engine, codec) for `random:tiny` or `random:full`, EOS suppressed. `config`: the engine's
    EngineConfig (KV pages, max batch); the rest as `gpu_engine.load_engine`."""
    preset = random_preset(model)
    if preset is None:
        raise ConfigError(f"{model!r} is not a random model ({PREFIX}tiny or {PREFIX}full)")
    if arch not in ARCHS:
        raise ConfigError(f"arch must be one of {ARCHS}, got {arch!r}")
    config = config or EngineConfig()
    log.warning(WARNING, model, arch)
    t0 = time.perf_counter()
    if preset == "tiny":
        engine, codec = _tiny(arch, device, dtype, config, cuda_graphs, kernels, seed)
    else:
        if torch.device(device).type != "cuda":
            raise ConfigError(f"{model} runs on CUDA only (GpuEngine, ~8 GB of bf16 weights); "
                              f"use {PREFIX}tiny on {device}")
        engine, codec = _full(arch, device, dtype or torch.bfloat16, config, cuda_graphs, kernels, seed)
    log.warning("random %s %s model ready in %.1f s (%s on %s); its output is noise, never speech",
                preset, arch, time.perf_counter() - t0, type(engine).__name__, engine.device)
    return engine, codec


# ---------------------------------------------------------------------------------- builders
def _tiny(arch: str, device: Any, dtype: torch.dtype | None, config: EngineConfig, cuda_graphs: bool,
          kernels: str, seed: int) -> tuple[Engine, Any]:
    from higgs_stream.engine.gpu_engine import load_engine
    from higgs_stream.engine.make_checkpoint import write_checkpoint
    from higgs_stream.engine.model_registry import load_codec_for

    tmp = Path(tempfile.mkdtemp(prefix="higgs-random-tiny-"))
    try:  # everything is read into memory; the directory goes once loaded
        root = write_checkpoint(tmp / arch, arch=arch, preset="tiny", seed=seed)
        engine = load_engine(str(root), device=device, dtype=dtype, config=config, cuda_graphs=cuda_graphs,
                             kernels=kernels)
        codec = load_codec_for(root, device=device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    suppress_eos(engine)
    return engine, codec


def _full(arch: str, device: Any, dtype: torch.dtype, config: EngineConfig, cuda_graphs: bool, kernels: str,
          seed: int) -> tuple[Engine, Any]:
    return in_memory_engine(arch, "full", device, dtype, config, cuda_graphs, kernels, seed), random_full_codec(seed)


def in_memory_engine(arch: str, preset: str, device: Any, dtype: torch.dtype, config: EngineConfig,
                     cuda_graphs: bool = True, kernels: str = "fast", seed: int = 0, eos: bool = False) -> Engine:
    """A GpuEngine over a random talker drawn in memory (no files), EOS suppressed unless `eos`.
    `random:full` uses it with preset "full" on CUDA; tests run it with "tiny" on the CPU (kernels="ref")."""
    from higgs_stream.engine.gpu_engine import GpuEngine, GpuEngineConfig
    from higgs_stream.engine.kv_cache import KVCache

    talker, cfg, tokenizer = (_talker_v2 if arch == "v2" else _talker_v3)(preset, device, dtype, config.max_seq_len, seed)
    if not eos:
        _zero_eos_rows(talker, cfg)  # before the engine takes views of the head (the graphs read it in place)
    cache = KVCache.create(cfg, num_pages=config.kv_pages, page_size=config.page_size, dtype=talker.dtype,
                           device=device)
    gpu = GpuEngineConfig(cuda_graphs=cuda_graphs and kernels == "fast", kernels=kernels)
    engine = GpuEngine(talker, cfg, tokenizer, cache, config, gpu)
    if not eos:
        suppress_eos(engine)
    return engine


@torch.no_grad()
def _talker_v2(preset: str, device: Any, dtype: torch.dtype, max_positions: int,
               seed: int) -> tuple[torch.nn.Module, Any, Any]:
    """The v2 talker with the weights `random_reference` draws (via transformers' reference, fp32 then `dtype`)."""
    tokenizer, cfg = tokenizer_and_config(preset)
    hf = random_reference(cfg, device, seed=seed)
    talker = talker_from_reference(hf, cfg, dtype)
    del hf
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    assert talker.max_positions >= max_positions, f"talker holds {talker.max_positions} positions < {max_positions}"
    return talker, cfg, tokenizer


def tokenizer_and_config(preset: str = "full", **dims: Any) -> tuple[TextTokenizer, TalkerConfig]:
    """A project tokenizer (byte-level BPE + the 256 Higgs special tokens) and its talker config."""
    cfg = talker_config(preset)
    if dims:
        cfg = replace(cfg, **dims)
    return TextTokenizer(build_text_tokenizer(BPE_VOCAB[preset])), cfg


@torch.no_grad()
def random_reference(cfg: TalkerConfig, device: str | torch.device, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    """transformers' HiggsAudioV2ForConditionalGeneration (fp32, eval) with seeded random weights."""
    from transformers import HiggsAudioV2Config, HiggsAudioV2ForConditionalGeneration

    s = cfg.special
    hf_cfg = HiggsAudioV2Config(**cfg.to_hf_dict(), audio_delay_token_id=s.begin_of_text + 14)
    with torch.device(device):
        hf = HiggsAudioV2ForConditionalGeneration(hf_cfg).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    for _, p in sorted(hf.named_parameters()):
        if p.dim() == 1:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen, device=device))
    return hf


@torch.no_grad()
def talker_from_reference(hf: torch.nn.Module, cfg: TalkerConfig, dtype: torch.dtype) -> Talker:
    """Our Talker (no text head) on the reference's device, holding its weights in `dtype`."""
    device = next(hf.parameters()).device
    with torch.device("meta"):
        talker = Talker(cfg, use_text_head=False)
    talker = talker.to_empty(device=device).to(dtype)
    talker.load_state_dict(hf.state_dict(), strict=True)
    talker.inv_freq = llama3_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    talker.model.embed_audio_tokens.offsets.copy_(torch.arange(cfg.num_codebooks, device=device) * cfg.audio_vocab)
    return talker.eval()


@torch.no_grad()
def _talker_v3(preset: str, device: Any, dtype: torch.dtype, max_positions: int,
               seed: int) -> tuple[torch.nn.Module, Any, Any]:
    """The v3 talker (Qwen3) drawn on the device as make_checkpoint_v3 draws it: matrices and
    embeddings N(0, std^2), norms 1 + N(0, 0.1^2); backbone and fused audio matrix in `dtype`."""
    from higgs_stream.engine.checkpoint import parameters_on_meta
    from higgs_stream.engine.config_v3 import V3SpecialTokens
    from higgs_stream.engine.make_checkpoint_v3 import build_v3_tokenizer, preset_v3
    from higgs_stream.engine.talker_v3 import TalkerV3
    from higgs_stream.engine.tokenizer import TextTokenizer

    p = preset_v3(preset)
    tokenizer = TextTokenizer(build_v3_tokenizer(p.bpe_vocab, p.added), specials=V3SpecialTokens)
    cfg = p.config.with_special(tokenizer.special)
    with parameters_on_meta():
        talker = TalkerV3(cfg, max_positions=max_positions)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, meta in sorted(talker.state_dict().items()):  # parameters only: the buffers are not persistent
        noise = torch.randn(meta.shape, generator=gen, device=device, dtype=torch.float32)
        tensors[name] = (1.0 + 0.1 * noise if name.endswith("norm.weight") else p.init_std * noise).to(dtype)
        del noise
    result = talker.load_state_dict(tensors, strict=True, assign=True)
    assert not result.missing_keys and not result.unexpected_keys, f"TalkerV3 keys: {result}"
    talker.to(device)  # buffers (RoPE inverse frequencies, codebook offsets)
    talker.requires_grad_(False)
    return talker.eval(), cfg, tokenizer


def random_full_codec(seed: int = 0) -> Any:
    """The full-size Higgs codec decoder (random weights, fp32) on the GPU."""
    from higgs_stream.engine.codec.codec import Codec
    from higgs_stream.engine.codec.config import CodecConfig

    torch.manual_seed(seed)
    codec = Codec(CodecConfig.full(), with_encoder=False)
    with torch.no_grad():
        for name, buf in codec.named_buffers():
            if name.endswith("codebook.embed"):
                buf.normal_()
    return codec.cuda().eval()


# ---------------------------------------------------------------------------------- EOS
def _audio_head(talker: torch.nn.Module) -> torch.Tensor:
    """[K * V, H] audio head of either family (v3: the fused matrix, also the audio embedding)."""
    head = getattr(talker, "audio_lm_head", None)
    return head.weight if head is not None else talker.audio.embedding.weight


@torch.no_grad()
def _zero_eos_rows(talker: torch.nn.Module, cfg: Any) -> None:
    weight = _audio_head(talker)
    weight.view(cfg.num_codebooks, cfg.audio_vocab, -1)[:, cfg.audio_stream_eos_id] = 0  # [K, V, H]


@torch.no_grad()
def suppress_eos(engine: Engine) -> None:
    """Make EOS unreachable (random weights only): zero its audio-head rows, in the talker and in the
    fast path's head (views of the same matrix, zeroed in place so captured graphs see it), and cap
    every request's top-k at EOS_TOP_K (greedy requests are left alone: logit 0 is never the argmax)."""
    cfg = engine.cfg
    _zero_eos_rows(engine.talker, cfg)
    fast = getattr(engine, "fast", None)
    if fast is not None:
        fast.audio_head.view(cfg.num_codebooks, cfg.audio_vocab, -1)[:, cfg.audio_stream_eos_id] = 0
    add = engine.add

    def add_capped(request: GenerationRequest) -> int:
        s = request.sampling
        if not s.greedy and (s.top_k is None or s.top_k > EOS_TOP_K):
            request = replace(request, sampling=replace(s, top_k=EOS_TOP_K))
        return add(request)

    engine.add = add_capped  # type: ignore[method-assign]
