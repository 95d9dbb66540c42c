"""`higgs-stream synth`: offline text -> WAV through the same engine and decode path the server uses."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="hub id or local checkpoint directory (Higgs Audio v2 or v3)")
    p.add_argument("--codec", default=None,
                   help="v2 only: codec dir/hub id (default: MODEL/audio_tokenizer, else the hub codec); "
                        "v3 checkpoints bundle their codec")
    p.add_argument("--text", required=True)
    p.add_argument("--ref-audio", default=None, help="reference WAV for voice cloning")
    p.add_argument("--ref-text", default=None, help="transcript of --ref-audio")
    p.add_argument("--scene", default=None, help="v2 only: scene description (default: quiet room)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-frames", type=int, default=None, help="hard cap on generated audio frames (25/s)")
    p.add_argument("--device", default="cpu", help="cpu (fp32 engine) or cuda (the GPU fast path, bf16)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="debug: on cuda, run decode steps eagerly")
    p.add_argument("--kernels", choices=("fast", "ref"), default="fast",
                   help="debug: on cuda, 'ref' runs the plain-torch kernels (no Triton/FlashInfer, no graphs)")
    p.add_argument("--quantize", choices=("none", "fp8", "int8"), default="none",
                   help="backbone linears at load: fp8 (W8A8, CUDA compute capability >= 8.9) or int8 "
                        "(weight-only, any device); embeddings, heads, norms and the codec stay as loaded")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="K/V pages in the model dtype (auto) or fp8 e4m3 (half of bf16's bytes)")
    p.add_argument("--out", default=None, help="output WAV (24 kHz mono s16le)")
    p.add_argument("--codes-out", default=None, help="write the codec frames [K, F] as .npy (what the codec decodes)")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from higgs_stream.engine.codec import load_reference_audio
    from higgs_stream.engine.engine import EngineConfig, load_engine
    from higgs_stream.engine.errors import ConfigError, InvalidInputError
    from higgs_stream.engine.startup_checks import check_device, check_output_path
    from higgs_stream.engine.gpu_memory import HEADROOM_GB, bound_process_memory
    from higgs_stream.engine.models.registry import load_codec_for
    from higgs_stream.engine.request import GenerationRequest, Reference, SamplingParams
    from higgs_stream.engine.synth import synthesize
    from higgs_stream.stream.adapter import write_wav

    if args.out is None and args.codes_out is None:
        raise InvalidInputError("nothing to write: pass --out and/or --codes-out")
    if (args.ref_audio is None) != (args.ref_text is None):
        raise InvalidInputError("--ref-audio and --ref-text go together")
    check_device(args.device)  # and the outputs' folders: before the model loads, not after the synthesis
    check_output_path("--out", args.out)
    check_output_path("--codes-out", args.codes_out)
    outs = [os.path.realpath(p) for p in (args.out, args.codes_out) if p]
    if args.ref_audio and os.path.realpath(args.ref_audio) in outs or len(set(outs)) < len(outs):
        raise ConfigError("--out, --codes-out and --ref-audio must be different files (the input was overwritten)")
    codec = load_codec_for(args.model, args.codec, device=args.device)
    engine = load_engine(args.model, device=args.device, cuda_graphs=not args.no_cuda_graphs, kernels=args.kernels,
                         quantize=args.quantize, config=EngineConfig(kv_cache_dtype=args.kv_cache_dtype))
    # CUDA: the codec's convolutions pick their cuDNN plans within what the process holds plus HEADROOM_GB, not
    # within the card's free memory (engine/gpu_memory.py: a plan with a ~80 GB workspace decoded wrong on an H200)
    bound_process_memory(args.device, HEADROOM_GB)
    reference = None
    if args.ref_audio:
        wav, sr = load_reference_audio(Path(args.ref_audio))
        reference = Reference(codes=codec.encode(wav, sr), transcript=args.ref_text)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    kwargs = {} if args.max_frames is None else {"max_frames": args.max_frames}
    request = GenerationRequest(text=args.text, reference=reference, scene=args.scene, sampling=sampling, **kwargs)
    wav, frames = synthesize(engine, codec, request)
    if args.codes_out:
        np.save(args.codes_out, frames)
    if args.out:
        write_wav(args.out, wav, codec.sample_rate)
    print(f"{len(wav) / codec.sample_rate:.2f} s of audio, {frames.shape[1]} frames")
    return 0
