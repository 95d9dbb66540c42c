"""Reference fixtures for the Qwen3-TTS family, made with the official PyPI `qwen-tts` 0.1.1.

Run it in the reference venv (qwen-tts pins transformers 4.57.3; this project needs 5.x):

    scripts/qwen3_reference_venv.sh                       # creates .qwen-ref-venv/ (idempotent)
    .qwen-ref-venv/bin/python scripts/qwen3_reference_fixtures.py
    .qwen-ref-venv/bin/python scripts/qwen3_reference_fixtures.py --check-layout CKPT   # make-checkpoint's output

It builds tiny random models with the reference's own classes at fixed seeds, writes them in the
hub repos' on-disk layout (what `Qwen3TTSForConditionalGeneration.from_pretrained` reads: config.json,
generation_config.json, model.safetensors, speech_tokenizer/{config.json, model.safetensors}) and
records the reference's outputs in reference.npz. `tiny/` is a CustomVoice checkpoint; `tiny_base/` is
the Base variant (config.json with its speaker_encoder_config; model.safetensors: the same talker
weights plus speaker_encoder.*) without a speech_tokenizer of its own (the tests pair it with tiny's). The test suite compares our code against these
files and never needs the reference venv; rerunning this script must reproduce them (the seeds are
fixed; reference.json records the versions that made them).

Weights are rounded to bf16 (the hub checkpoints' dtype) and stored so; every reference output is
computed in fp32 from exactly those weights.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "tests/engine/models/qwen3_tts/fixtures"
SEED = 1234

# ---------------------------------------------------------------- tiny configs
CODEBOOK = 64  # codes per group (the real 12 Hz tokenizer: 2048)
GROUPS = 16
CODEC_VOCAB = 1024 + CODEBOOK  # the reference's generate() suppresses [vocab - 1024, vocab) but EOS
TEXT_IDS = dict(tts_pad_token_id=150, tts_bos_token_id=151, tts_eos_token_id=152,
                im_start_token_id=153, im_end_token_id=154)
SPECIAL = dict(codec_pad_id=CODEBOOK + 100, codec_bos_id=CODEBOOK + 101, codec_eos_token_id=CODEBOOK + 102,
               codec_think_id=CODEBOOK + 106, codec_nothink_id=CODEBOOK + 107, codec_think_bos_id=CODEBOOK + 108,
               codec_think_eos_id=CODEBOOK + 109)
LANGUAGES = {"english": CODEBOOK + 2, "chinese": CODEBOOK + 7, "beijing_dialect": CODEBOOK + 20}
SPEAKERS = {"aiden": CODEBOOK + 900, "dylan": CODEBOOK + 901}
DIALECTS = {"aiden": False, "dylan": "beijing_dialect"}

TALKER = dict(
    vocab_size=CODEC_VOCAB, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
    rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
    num_code_groups=GROUPS, text_hidden_size=24, text_vocab_size=160, hidden_act="silu",
    spk_id=SPEAKERS, spk_is_dialect=DIALECTS, codec_language_id=LANGUAGES, **SPECIAL,
    code_predictor_config=dict(
        vocab_size=CODEBOOK, hidden_size=8, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
        num_code_groups=GROUPS, hidden_act="silu"),
)
DECODER = dict(
    codebook_size=CODEBOOK, codebook_dim=8, hidden_size=16, latent_dim=12, max_position_embeddings=512,
    rope_theta=10000.0, num_attention_heads=2, num_key_value_heads=2, head_dim=8, sliding_window=4,
    intermediate_size=24, num_hidden_layers=2, num_quantizers=GROUPS, upsample_rates=[8, 5, 4, 3],
    upsampling_ratios=[2, 2], decoder_dim=32, layer_scale_initial_scale=0.01, rms_norm_eps=1e-5,
)
ENCODER = dict(  # a tiny Mimi (transformers MimiConfig): hop 1920 at 24 kHz, 16 of its 20 quantizers kept (the
    # released: 16 of 32); hidden_size != the quantizer's dimension, so the RVQs' input projections are exercised
    sampling_rate=24000, frame_rate=12.5, audio_channels=1, hidden_size=12, num_filters=2, num_residual_layers=1,
    upsampling_ratios=[8, 6, 5, 4], kernel_size=7, last_kernel_size=3, residual_kernel_size=3, dilation_growth_rate=2,
    use_causal_conv=True, pad_mode="constant", compress=2, trim_right_ratio=1.0, codebook_size=CODEBOOK,
    codebook_dim=8, num_quantizers=GROUPS + 4, use_conv_shortcut=False, vector_quantization_hidden_dimension=8,
    num_semantic_quantizers=1, upsample_groups=4, num_hidden_layers=1, intermediate_size=16,
    num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=16,
    rope_theta=10000.0, layer_scale_initial_scale=0.01, use_streaming=False,
)
SPEAKER = dict(  # a tiny ECAPA-TDNN x-vector encoder (the released: channels [512]*4 + [1536], enc_dim = talker
    # hidden); mel_dim stays 128: the reference's mel front end always makes 128 bins
    mel_dim=128, enc_dim=TALKER["hidden_size"], enc_channels=[16, 16, 16, 32], enc_kernel_sizes=[5, 3, 3, 1],
    enc_dilations=[1, 2, 3, 1], enc_attention_channels=8, enc_res2net_scale=4, enc_se_channels=4, sample_rate=24000,
)
GENERATION = dict(do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
                  subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0, subtalker_temperature=0.9,
                  max_new_tokens=8192)

DECODE_FRAMES = 9  # > the tiny sliding window (4) and the causal conv histories
LONG_FRAMES = 111  # talker steps of the long scenario: 110 greedy frames
SLICE = CODEBOOK + 1  # stored decode-step logits: the code columns and EOS (the rest are suppressed specials)


# ---------------------------------------------------------------- helpers
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randomize(model: torch.nn.Module, seed: int, out_scale: dict[str, float] | None = None) -> None:
    """Every parameter drawn at a scale that keeps activations O(1) (the library inits leave snake,
    layer-scale and ConvNeXt gains at values that hide whole paths), then rounded to bf16."""
    g = _gen(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "cluster_usage":
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif leaf in ("alpha", "beta"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif leaf in ("scale", "gamma"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 0.5)
            elif leaf == "embedding_sum" or "embedding" in name and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # norms around 1, biases around 0
                base = 1.0 if "norm" in name and leaf == "weight" else 0.0
                p.copy_(base + torch.randn(p.shape, generator=g) * 0.1)
            else:
                fan_in = p[0].numel() if "conv" not in name or p.dim() < 3 else p.shape[1] * p.shape[2]
                if isinstance(_module_of(model, name), torch.nn.ConvTranspose1d):
                    fan_in = p.shape[0] * p.shape[2] // max(1, _module_of(model, name).stride[0])
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
            for pattern, s in (out_scale or {}).items():
                if re.search(pattern, name):
                    p.mul_(s)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        for name, b in model.named_buffers():  # Mimi keeps its codebooks in buffers
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "embed_sum":
                b.copy_(torch.randn(b.shape, generator=g).to(torch.bfloat16).to(b.dtype))
            elif leaf == "cluster_usage":
                b.copy_((torch.rand(b.shape, generator=g) + 0.5).to(torch.bfloat16).to(b.dtype))
            elif leaf == "initialized":
                b.fill_(1)  # (RoPE frequency buffers are derived, never stored: left as built)


def _module_of(model: torch.nn.Module, param_name: str) -> torch.nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])


def _calibrate_output(decoder) -> None:
    """Scale the decoder's last conv so a random utterance's pre-clamp waveform has rms 0.25 (mostly
    inside the final clamp to [-1, 1], which would otherwise hide most samples from the comparison)."""
    seen = []
    last = decoder.decoder[-1]
    hook = last.register_forward_hook(lambda _m, _a, y: seen.append(y))
    with torch.no_grad():
        decoder(torch.randint(0, CODEBOOK, (1, GROUPS, 16), generator=_gen(SEED + 99)))
        hook.remove()
        rms = float(seen[0].pow(2).mean().sqrt())
        for p in last.parameters():
            p.mul_(0.25 / rms)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def save_bf16(model, path: Path) -> None:
    """save_pretrained of a bf16 copy (the hub dtype); `model` stays untouched in fp32 (a round trip
    through bf16 would also round its RoPE frequency buffers)."""
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.config.dtype = "bfloat16"
    model.save_pretrained(path, state_dict=state, safe_serialization=True)


# ---------------------------------------------------------------- tokenizer (12 Hz codec)
def build_tokenizer(root: Path, out: dict):
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

    cfg = Qwen3TTSTokenizerV2Config(encoder_config=ENCODER, decoder_config=DECODER, encoder_valid_num_quantizers=GROUPS,
                                    input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920,
                                    encode_downsample_rate=1920)
    cfg._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = Qwen3TTSTokenizerV2Model(cfg).eval()
    # residual branches at 0.3 gain keep the decoder blocks' activations O(1): growing ones feed Snake's
    # sin(x * alpha) large arguments and make the random model amplify fp32 rounding ~1000x
    randomize(model.decoder, SEED + 1, out_scale={r"^decoder\.\d+\.block\.[234]\.conv2\.": 0.3})
    _calibrate_output(model.decoder)
    randomize(model.encoder, SEED + 2)
    save_bf16(model, root / "speech_tokenizer")
    g = _gen(SEED + 3)
    codes = torch.randint(0, CODEBOOK, (1, GROUPS, DECODE_FRAMES), generator=g)  # [B, Q, F]
    with torch.no_grad():
        wav = model.decoder(codes)  # [B, 1, F * 1920]
        chunked = model.decode(codes.transpose(1, 2)).audio_values  # the public decode (trimmed to length)
    assert torch.equal(torch.stack(chunked), wav[:, 0]), "public decode != decoder forward for a short input"
    out["decode_codes"] = codes.numpy().astype(np.int16)
    out["decode_wav"] = wav[:, 0].numpy()
    clipped = float((wav.abs() >= 1).float().mean())
    print(f"decoder: peak {float(wav.abs().max()):.3f}, rms {float(wav.pow(2).mean().sqrt()):.3f}, "
          f"clamped {clipped:.1%}", file=sys.stderr)
    # encode: 0.5 s of a random waveform (two lengths, the second padded inside the batch)
    pcm = (torch.randn(2, 12000, generator=g) * 0.3 * 32767).clamp(-32767, 32767).round().to(torch.int16)
    audio = pcm.float() / 32768.0  # stored as s16 (exact), given to both sides as x / 32768
    mask = torch.ones(2, 12000, dtype=torch.long)
    mask[1, 9000:] = 0
    with torch.no_grad():
        enc = model.encode(audio, padding_mask=mask).audio_codes
    out["encode_pcm"] = pcm.numpy()
    out["encode_lengths"] = np.array([12000, 9000])
    out["encode_codes_0"] = enc[0].numpy().astype(np.int16)  # [F, Q]
    out["encode_codes_1"] = enc[1].numpy().astype(np.int16)
    return model


# ---------------------------------------------------------------- talker + code predictor
def build_talker(root: Path, variant: str = "custom_voice"):
    """The tiny talker; `base` adds the speaker encoder (drawn after the talker, whose weights are then the
    same as the custom_voice model's: same seed, same parameter order)."""
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration

    extra = dict(speaker_encoder_config=SPEAKER) if variant == "base" else {}
    cfg = Qwen3TTSConfig(talker_config=TALKER, tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size="0b6",
                         tts_model_type=variant, **TEXT_IDS, **extra)
    cfg._attn_implementation = "eager"
    cfg.talker_config._attn_implementation = "eager"
    cfg.talker_config.code_predictor_config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = Qwen3TTSForConditionalGeneration(cfg).eval()
    randomize(model, SEED + 10)
    with torch.no_grad():  # EOS never wins a greedy step: the long scenario runs its full length
        model.talker.codec_head.weight[SPECIAL["codec_eos_token_id"]] = 0.0
    save_bf16(model, root)
    (root / "generation_config.json").write_text(json.dumps(GENERATION, indent=2))
    return model


def run_scenario(model, name: str, out: dict, *, frames: int, text_ids, language: str, speaker=None,
                 instruct_ids=None, non_streaming: bool, ref=None) -> None:
    """Greedy generation through the reference's own `generate`, with its talker prefill logits at every
    position, raw decode-step logits and the code predictor's logits per group."""
    talker = model.talker
    seen: dict = {"prefill": None, "cp_logits": []}
    original = talker.generate

    def capture_generate(**kw):
        seen["prefill"] = kw["inputs_embeds"].clone()
        seen["trailing"] = kw["trailing_text_hidden"].clone()
        return original(**kw, output_logits=True)

    def cp_hook(_module, _args, result):
        seen["cp_logits"].append(result.logits[:, -1].clone())

    talker.generate = capture_generate
    hook = talker.code_predictor.register_forward_hook(cp_hook)
    try:
        kwargs = dict(input_ids=[torch.tensor([text_ids])], languages=[language], speakers=[speaker],
                      non_streaming_mode=non_streaming, max_new_tokens=frames, do_sample=False,
                      subtalker_dosample=False, repetition_penalty=1.05)
        if instruct_ids is not None:
            kwargs["instruct_ids"] = [torch.tensor([instruct_ids])]
        if ref is not None:
            kwargs["ref_ids"] = [torch.tensor([ref["ids"]])]
            kwargs["voice_clone_prompt"] = dict(ref_code=[torch.from_numpy(ref["codes"])],
                                                ref_spk_embedding=[torch.from_numpy(ref["spk"])],
                                                x_vector_only_mode=[False], icl_mode=[True])
            kwargs["speakers"] = None
        with torch.no_grad():
            codes_list, _ = model.generate(**kwargs)
    finally:
        talker.generate = original
        hook.remove()
    codes = codes_list[0]  # [F, 16]
    with torch.no_grad():
        prefill = seen["prefill"]  # [1, P, H]
        hidden = talker.model(inputs_embeds=prefill, use_cache=False).last_hidden_state
        prefill_logits = talker.codec_head(hidden)[0]  # [P, V]
    # decode-step logits: teacher-forced through the reference talker with its own cache
    step_logits = _decode_logits(model, prefill, seen["trailing"], codes)
    keep = 8 if name == "custom" else 2
    cp = torch.stack(seen["cp_logits"][: 15 * keep]).view(-1, 15, CODEBOOK)  # first frames [n, 15, V]
    p = f"{name}_"
    out[p + "prompt_embeds"] = prefill[0].numpy()
    out[p + "prefill_logits"] = prefill_logits[:, :SLICE].numpy()
    out[p + "prefill_logits_last"] = prefill_logits[-1].numpy()
    out[p + "step_logits"] = step_logits[:, :SLICE].numpy()
    if name == "custom":
        out[p + "step_logits_full"] = step_logits[1:3].numpy()
    out[p + "cp_logits"] = cp.numpy()
    out[p + "codes"] = codes.numpy().astype(np.int16)
    print(f"{name}: prompt {prefill.shape[1]} positions, {codes.shape[0]} frames", file=sys.stderr)
    # the reference completes a frame (its code predictor) in the talker step after its group 0, so
    # max_new_tokens=N yields N-1 frames
    assert codes.shape[0] == frames - 1, f"{name}: {codes.shape[0]} frames, expected {frames - 1}"


def _decode_logits(model, prefill, trailing, codes) -> torch.Tensor:
    """Raw talker logits at each decode step (what HF generate's output_logits holds), recomputed from the
    greedy codes: step 0 is the prefill's last position; step t feeds frame t-1's 16 codes summed."""
    from transformers.cache_utils import DynamicCache

    talker = model.talker
    cache = DynamicCache()
    with torch.no_grad():
        h = talker.model(inputs_embeds=prefill, past_key_values=cache, use_cache=True).last_hidden_state
        logits = [talker.codec_head(h[:, -1])]
        pad = model.talker.text_projection(model.talker.get_text_embeddings()(
            torch.tensor([[model.config.tts_pad_token_id]])))
        for t in range(codes.shape[0] - 1):
            frame = codes[t]
            e = talker.get_input_embeddings()(frame[:1])
            for i in range(1, GROUPS):
                e = e + talker.code_predictor.get_input_embeddings()[i - 1](frame[i:i + 1])
            e = e[None]  # [1, 1, H]
            e = e + (trailing[:, t:t + 1] if t < trailing.shape[1] else pad)
            h = talker.model(inputs_embeds=e, past_key_values=cache, use_cache=True).last_hidden_state
            logits.append(talker.codec_head(h[:, -1]))
    return torch.cat(logits)  # [F, V]


def check_layout(root: Path) -> int:
    """Load a checkpoint that `higgs-stream make-checkpoint --arch qwen3-tts` wrote with the reference's
    classes; report (and fail on) any tensor the reference misses or does not expect."""
    from qwen_tts.core import Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from transformers import PreTrainedModel

    bad = 0
    _, info = Qwen3TTSTokenizerV2Model.from_pretrained(root / "speech_tokenizer", output_loading_info=True)
    bad += sum(len(v) for v in info.values())
    print(f"speech_tokenizer: {info}", file=sys.stderr)
    # the class's own from_pretrained also loads the feature extractor (preprocessor_config.json, not written)
    _, info = PreTrainedModel.from_pretrained.__func__(Qwen3TTSForConditionalGeneration, root, output_loading_info=True)
    bad += sum(len(v) for v in info.values())
    print(f"model: {info}", file=sys.stderr)
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check-layout", type=Path, metavar="CKPT",
                    help="instead: load a make-checkpoint output with the reference's classes and list any "
                         "missing or unexpected tensor")
    args = ap.parse_args()
    import qwen_tts  # noqa: F401  (fails loudly outside the reference venv)
    import transformers

    if args.check_layout is not None:
        sys.exit(check_layout(args.check_layout))

    root = args.out / "tiny"
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, np.ndarray] = {}
    torch.set_num_threads(1)
    tokenizer = build_tokenizer(root, out)
    model = build_talker(root)
    g = np.random.default_rng(SEED)
    im_start, im_end = TEXT_IDS["im_start_token_id"], TEXT_IDS["im_end_token_id"]
    assistant, user, newline = 11, 12, 13

    def chat(body, role=assistant, tail=True):
        ids = [im_start, role, newline, *body, im_end, newline]
        return ids + [im_start, assistant, newline] if tail else ids

    text_a = g.integers(20, 140, 9).tolist()
    run_scenario(model, "custom", out, frames=LONG_FRAMES, text_ids=chat(text_a), language="english",
                 speaker="aiden", non_streaming=False)
    text_b = g.integers(20, 140, 6).tolist()
    instruct = chat(g.integers(20, 140, 5).tolist(), role=user, tail=False)
    run_scenario(model, "design", out, frames=24, text_ids=chat(text_b), language="auto", speaker=None,
                 instruct_ids=instruct, non_streaming=True)
    run_scenario(model, "dialect", out, frames=12, text_ids=chat(text_b), language="chinese", speaker="dylan",
                 non_streaming=False)
    ref = dict(ids=chat(g.integers(20, 140, 4).tolist(), tail=False),
               codes=g.integers(0, CODEBOOK, (7, GROUPS)).astype(np.int64),
               spk=(g.standard_normal(TALKER["hidden_size"])).astype(np.float32))
    run_scenario(model, "clone", out, frames=16, text_ids=chat(text_a), language="english", non_streaming=False,
                 ref=ref)
    out["scenario_text_a"], out["scenario_text_b"] = np.array(chat(text_a)), np.array(chat(text_b))
    out["scenario_instruct"] = np.array(instruct)
    out["clone_ref_ids"], out["clone_ref_codes"], out["clone_spk"] = np.array(ref["ids"]), ref["codes"], ref["spk"]
    # Base from reference audio: the x-vector of the encode waveforms, then the clone scenario with the codes
    # and embedding the reference computes from encode_pcm[0] (what create_voice_clone_prompt does at 24 kHz)
    base = build_talker(args.out / "tiny_base", variant="base")
    for i, n in enumerate(out["encode_lengths"]):
        wav = out["encode_pcm"][i, :n].astype(np.float32) / 32768.0
        out[f"speaker_embedding_{i}"] = base.extract_speaker_embedding(wav, 24000).float().numpy()
    wav = out["encode_pcm"][0].astype(np.float32) / 32768.0
    with torch.no_grad():
        codes = tokenizer.encode(torch.from_numpy(wav)[None], padding_mask=torch.ones(1, wav.shape[0], dtype=torch.long)).audio_codes[0]
    assert np.array_equal(codes.numpy(), out["encode_codes_0"]), "tokenizer encode is not deterministic"
    run_scenario(base, "clone_audio", out, frames=16, text_ids=chat(text_a), language="english", non_streaming=False,
                 ref=dict(ids=ref["ids"], codes=codes.numpy().astype(np.int64), spk=out["speaker_embedding_0"]))
    for k in [k for k in out if k.startswith("clone_audio_") and k != "clone_audio_codes"]:
        del out[k]  # its logits are the clone scenario's kind: the frames are what the Base tests compare
    np.savez(args.out / "reference.npz", **out)
    meta = dict(script="scripts/qwen3_reference_fixtures.py", seed=SEED, qwen_tts="0.1.1",
                transformers=transformers.__version__, torch=torch.__version__,
                scenarios={"custom": "CustomVoice aiden, english, streaming text, 110 greedy frames",
                           "design": "VoiceDesign instruction, auto language, non-streaming text, 24 frames",
                           "dialect": "CustomVoice dylan (beijing dialect), chinese, streaming text, 12 frames",
                           "clone": "Base ICL: reference ids + codes + speaker embedding, 16 frames",
                           "clone_audio": "Base ICL (tiny_base, speaker encoder) with the codes and x-vector the "
                                          "reference computes from encode_pcm[0], 16 frames"},
                talker_logits=f"prefill positions and decode steps store columns [0, {SLICE}) (codes and EOS; "
                              "the other specials are suppressed at decode); all columns at the prefill's last "
                              "position and, for 'custom', decode steps 1-2")
    (args.out / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out} ({total / 1024:.0f} KiB)", file=sys.stderr)


if __name__ == "__main__":
    main()
