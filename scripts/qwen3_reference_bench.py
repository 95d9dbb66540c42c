"""Generation speed of the official Qwen3-TTS package (PyPI `qwen-tts` 0.1.1) at the released shapes.

Issue #13 compares our frame step with the reference package's own generation on the same GPU in the
same run. This script runs in the reference's environment (transformers 4.57.3, which qwen-tts pins; this
project needs 5.x): here `.qwen-ref-venv/` (scripts/qwen3_reference_venv.sh); on the GPU machine the
wheels of scripts/qwen3_ref_wheels.sh in a --target folder first on PYTHONPATH (`REF=1` in
scripts/gpu_qwen3.sh).

    .qwen-ref-venv/bin/python scripts/qwen3_reference_bench.py --size tiny --device cpu --frames 20 --out /tmp/r.json
    python3 scripts/qwen3_reference_bench.py --size 0.6b,1.7b --frames 64 --out ref.json      # CUDA, bf16

What is timed: `Qwen3TTSForConditionalGeneration.generate` with a CustomVoice speaker, the call that
`Qwen3TTSModel.generate_custom_voice` makes (same arguments: its token ids, languages, speakers,
non_streaming_mode=True (the wrapper's default) and the released generation_config.json's sampling:
top-k 50, temperature 0.9, repetition penalty 1.05, the code predictor sampling alike), under
torch.no_grad as the wrapper runs it. Left out, as our frame step leaves them out: the text tokenizer
(the token ids are fixed: a chat-template prompt around `--text-tokens` pseudo-random text ids) and the
speech tokenizer's decode to audio. The model is built with the reference's own classes at the
released CustomVoice shapes (0.6B, 1.7B; speaker/language ids are placeholders in the codec's special
range, as in our `qwen3_tts.config.preset`) with random weights (the library's init) directly in the
run's dtype (bf16 on CUDA, as `from_pretrained(..., dtype=torch.bfloat16)` gives; fp32 on CPU), with
`--attn` attention (transformers' default, sdpa; the GPU machine has no flash-attn).

Fixed length: `Qwen3TTSForConditionalGeneration.generate` passes `min_new_tokens=2` to the talker's
HF `generate` and forwards none of its own extra kwargs, so the talker's `generate` is wrapped to pass
`min_new_tokens = max_new_tokens` instead: HF's own min-length logits processor (already in the
reference's chain, now with a larger bound) masks codec EOS at every step. `max_new_tokens = frames + 1`:
the reference completes a frame (its 15 code-predictor groups) in the talker step after the one that
sampled its group 0, so N talker steps make N - 1 frames. Every run is checked to return exactly
`--frames` frames per stream.

A warm-up run (min(frames, 16) frames) precedes the timed runs; each timed run is synchronized before
and after; the median wall time of `--runs` runs gives frames/s (batch x frames / median) and ms per frame
(median / frames: the prefill is amortized in it, as in a user's call). Batch 1 and `--batch` (8; the
reference's generate pads a list of prompts into one batch), the same text in every row.

qwen_tts's package __init__ imports its inference wrappers and 25 Hz tokenizer, which import librosa,
soundfile and sox at module level (audio file I/O, resampling, a mel filterbank; none on this path).
Where one is not installed (the GPU machine: librosa would bring numba's stack), a stand-in module whose
every attribute raises takes its place; `--stub-audio` stubs them even where installed (to check here
that the stand-ins suffice). The JSON records which were stubbed.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

# ---------------------------------------------------------------- configs
# The released CustomVoice shapes (Qwen/Qwen3-TTS-12Hz-{0.6B,1.7B}-CustomVoice config.json; the same numbers
# as higgs_stream.engine.models.qwen3_tts.config.preset, which tests/engine/models/qwen3_tts/test_reference_bench.py
# checks). Speaker and language ids: placeholders in the codec's special range.
_LANGUAGES = ("chinese", "english", "german", "italian", "portuguese", "spanish", "japanese", "korean", "french",
              "russian", "beijing_dialect", "sichuan_dialect")
_SPEAKERS = ("vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee")
_DIALECTS = {"dylan": "beijing_dialect", "eric": "sichuan_dialect"}
RELEASED_TEXT_IDS = dict(tts_pad_token_id=151671, tts_bos_token_id=151672, tts_eos_token_id=151673,
                         im_start_token_id=151644, im_end_token_id=151645)
RELEASED_ROLE_IDS = dict(assistant=77091, newline=198)  # Qwen's tokenizer: "assistant", "\n"


def released_talker(size: str) -> dict:
    big = size == "1.7b"
    return dict(
        vocab_size=3072, hidden_size=2048 if big else 1024, intermediate_size=6144 if big else 3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "default", "interleaved": True, "mrope_section": [24, 20, 20]},
        num_code_groups=16, text_vocab_size=151936, text_hidden_size=2048,
        codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_think_id=2154, codec_nothink_id=2155,
        codec_think_bos_id=2156, codec_think_eos_id=2157,
        spk_id={s: 3000 + i for i, s in enumerate(_SPEAKERS)},
        spk_is_dialect={s: _DIALECTS.get(s, False) for s in _SPEAKERS},
        codec_language_id={lang: 2050 + i for i, lang in enumerate(_LANGUAGES)},
        code_predictor_config=dict(
            vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, num_code_groups=16,
            hidden_act="silu"),
    )


# tiny: the shapes of scripts/qwen3_reference_fixtures.py (a CPU check of this script, not a measurement)
TINY_TEXT_IDS = dict(tts_pad_token_id=150, tts_bos_token_id=151, tts_eos_token_id=152, im_start_token_id=153,
                     im_end_token_id=154)
TINY_ROLE_IDS = dict(assistant=11, newline=13)


def tiny_talker() -> dict:
    book = 64
    return dict(
        vocab_size=1024 + book, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
        num_code_groups=16, text_vocab_size=160, text_hidden_size=24, hidden_act="silu",
        codec_pad_id=book + 100, codec_bos_id=book + 101, codec_eos_token_id=book + 102, codec_think_id=book + 106,
        codec_nothink_id=book + 107, codec_think_bos_id=book + 108, codec_think_eos_id=book + 109,
        spk_id={"aiden": book + 900, "dylan": book + 901}, spk_is_dialect={"aiden": False, "dylan": "beijing_dialect"},
        codec_language_id={"english": book + 2, "chinese": book + 7, "beijing_dialect": book + 20},
        code_predictor_config=dict(
            vocab_size=book, hidden_size=8, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
            num_code_groups=16, hidden_act="silu"),
    )


SIZES = {"0.6b": "0b6", "1.7b": "1b7", "tiny": "0b6"}  # --size -> config tts_model_size
# the released generation_config.json (what generate_custom_voice merges in when the caller passes nothing)
SAMPLING = dict(do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
                subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0, subtalker_temperature=0.9)
SPEAKER, LANGUAGE = "aiden", "english"  # a CustomVoice speaker without a dialect


# ---------------------------------------------------------------- environment
AUDIO_MODULES = ("librosa", "soundfile", "sox")


def _stand_in(name: str) -> types.ModuleType:
    """A module whose every attribute raises on use: qwen_tts imports these at module level for audio
    I/O only; the generation path timed here never calls them."""
    mod = types.ModuleType(name)
    # a spec (find_spec must not raise: transformers probes packages with it) without distribution
    # metadata: transformers' availability checks then report the package absent
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    mod.__doc__ = f"stand-in for {name} (not installed): qwen-tts reference bench, generation path only"

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def missing(*_a, **_k):
            raise RuntimeError(f"{name}.{attr}: a stand-in (scripts/qwen3_reference_bench.py); not on the timed path")
        return missing

    mod.__getattr__ = __getattr__
    return mod


def stub_audio_modules(force: bool) -> list[str]:
    """Put stand-ins for librosa (and librosa.filters), soundfile and sox in sys.modules where they are
    not installed (or always, with `force`); returns the names stubbed."""
    stubbed = []
    for name in AUDIO_MODULES:
        if name in sys.modules and not force:
            continue
        if not force and importlib.util.find_spec(name) is not None:
            continue
        sys.modules[name] = _stand_in(name)
        stubbed.append(name)
    if "librosa" in stubbed:
        filters = _stand_in("librosa.filters")
        sys.modules["librosa.filters"] = filters
        sys.modules["librosa"].filters = filters
    return stubbed


# ---------------------------------------------------------------- model and prompt
def build_model(size: str, device: torch.device, dtype: torch.dtype, attn: str):
    """`Qwen3TTSForConditionalGeneration` (CustomVoice) at `size`, random weights (the library's own
    init), built directly on `device` in `dtype` (non-persistent RoPE buffers stay fp32, as from_pretrained
    leaves them), in eval mode."""
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    talker = tiny_talker() if size == "tiny" else released_talker(size)
    text_ids = TINY_TEXT_IDS if size == "tiny" else RELEASED_TEXT_IDS
    cfg = Qwen3TTSConfig(talker_config=talker, tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size=SIZES[size],
                         tts_model_type="custom_voice", **text_ids)
    for c in (cfg, cfg.talker_config, cfg.talker_config.code_predictor_config):
        c._attn_implementation = attn
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3TTSForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def prompt_ids(size: str, text_tokens: int, device: torch.device) -> torch.Tensor:
    """What generate_custom_voice tokenizes: `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`,
    the text as `text_tokens` fixed pseudo-random ids (seed 0) of the text vocabulary's ordinary range."""
    tiny = size == "tiny"
    ids = TINY_TEXT_IDS if tiny else RELEASED_TEXT_IDS
    role = TINY_ROLE_IDS if tiny else RELEASED_ROLE_IDS
    lo, hi = (20, 140) if tiny else (1000, 150000)
    text = torch.randint(lo, hi, (text_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    start, end, asst, nl = ids["im_start_token_id"], ids["im_end_token_id"], role["assistant"], role["newline"]
    return torch.tensor([[start, asst, nl, *text, end, nl, start, asst, nl]], device=device)


def force_length(model) -> None:
    """Make every generate run its full max_new_tokens: the talker's HF generate gets min_new_tokens =
    max_new_tokens (the reference hard-codes 2 and forwards no extra kwargs), so HF's min-length logits
    processor masks codec EOS at every step."""
    original = model.talker.generate

    def generate(*args, **kwargs):
        kwargs["min_new_tokens"] = kwargs["max_new_tokens"]
        return original(*args, **kwargs)

    model.talker.generate = generate


def generate_once(model, ids: torch.Tensor, batch: int, frames: int, device: torch.device, non_streaming: bool,
                  seed: int) -> float:
    """One CustomVoice generate call as generate_custom_voice makes it; wall seconds (synchronized)."""
    kwargs = dict(input_ids=[ids] * batch, instruct_ids=[None] * batch, languages=[LANGUAGE] * batch,
                  speakers=[SPEAKER] * batch, non_streaming_mode=non_streaming, max_new_tokens=frames + 1, **SAMPLING)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        codes, _ = model.generate(**kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    got = [int(c.shape[0]) for c in codes]
    if got != [frames] * batch:
        raise RuntimeError(f"expected {frames} frames per stream, got {got}")
    return wall


def bench_size(size: str, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    t0 = time.perf_counter()
    model = build_model(size, device, dtype, args.attn)
    force_length(model)
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    ids = prompt_ids(size, args.text_tokens, device)
    out = []
    for batch in sorted({1, args.batch}):
        generate_once(model, ids, batch, min(args.frames, 16), device, not args.streaming_text, seed=1234)  # warm-up
        walls = [generate_once(model, ids, batch, args.frames, device, not args.streaming_text, seed=i)
                 for i in range(args.runs)]
        med = statistics.median(walls)
        row = dict(size=size, batch=batch, frames=args.frames, runs_s=walls, median_s=med,
                   frames_per_s=batch * args.frames / med, ms_per_frame=med / args.frames * 1e3,
                   prompt_ids=int(ids.shape[1]), params=params, build_s=build_s)
        out.append(row)
        print(f"reference {size} b={batch}: {row['frames_per_s']:.1f} frames/s, {row['ms_per_frame']:.2f} ms/frame "
              f"(median of {args.runs} x {args.frames} frames, {med:.3f} s)", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="0.6b,1.7b", help="comma list of 0.6b, 1.7b, tiny (default 0.6b,1.7b)")
    ap.add_argument("--frames", type=int, default=64, help="frames per stream in every timed run (default 64)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per batch size; the median counts (default 3)")
    ap.add_argument("--batch", type=int, default=8, help="second batch size besides 1 (default 8; 1: batch 1 only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on CPU)")
    ap.add_argument("--attn", default="sdpa", help="attention implementation (default sdpa; eager)")
    ap.add_argument("--text-tokens", type=int, default=32, help="text ids in the prompt (default 32)")
    ap.add_argument("--streaming-text", action="store_true",
                    help="non_streaming_mode=False (the text fed along the frames; default: the wrapper's True)")
    ap.add_argument("--stub-audio", action="store_true",
                    help="stand-ins for librosa/soundfile/sox even where installed (what the GPU machine gets)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    sizes = [s.strip() for s in args.size.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            ap.error(f"unknown size {s!r}; expected one of {', '.join(SIZES)}")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))

    import transformers  # first: its optional-package probes see the environment as it is

    transformers.logging.set_verbosity_error()  # "Setting pad_token_id to eos_token_id" at every talker generate
    stubbed = stub_audio_modules(args.stub_audio)
    import qwen_tts  # noqa: F401  (the package as a user imports it: its __init__ pulls the audio modules)
    from importlib.metadata import version

    results = []
    for s in sizes:
        results += bench_size(s, args, device, dtype)
    meta = dict(script="scripts/qwen3_reference_bench.py", qwen_tts=version("qwen-tts"),
                transformers=transformers.__version__, torch=torch.__version__, python=sys.version.split()[0],
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", dtype=str(dtype),
                attn=args.attn, stubbed=stubbed, speaker=SPEAKER, language=LANGUAGE,
                non_streaming_mode=not args.streaming_text, sampling=SAMPLING,
                method="Qwen3TTSForConditionalGeneration.generate (CustomVoice), talker min_new_tokens = "
                       "max_new_tokens = frames + 1; no text tokenizer, no audio decode",
                results=results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()
