"""The talker's math for the engine's fast path: fused weights, fp32 residual stream, pluggable kernels.

`FastTalker(talker, kernels="fast"|"ref")` takes any family's plain-torch talker and its packed
weights (`talker.fast_weights() -> FastWeights`, written in each family's talker.py): each layer's
q/k/v and each MLP's gate/up projections are one matrix (the talker's own parameters become views
into those matrices: no second copy of the weights, `state_dict()` unchanged). It runs ragged steps
over the same paged KV pool as the talker's `forward`, but takes device tensors only and returns
the audio logits of selected rows, so the engine can keep its per-stream state on the device and
capture a decode step in a CUDA graph.

Per layer, with x the fp32 residual stream:

    h   = add_rms_norm(prev_mlp_out, x, input_norm[branch])          # x += prev; h bf16
    qkv = h @ W_qkv
    q   = rope_store_kv(qkv, qk_norm)                                 # k, v -> page pool; Qwen3 layers
                                                                      #   (v3, Qwen3-TTS) RMSNorm q, k heads first
    h   = add_rms_norm(o_proj(attention(q)), x, post_norm[branch])
    out = down(silu_and_mul(h @ W_gate_up[branch]))

A layer has one branch (Qwen3: Higgs v3) or two (DualFFN: Higgs v2, text rows take the text norms
and MLP, audio rows the audio ones); QK-norm weights are optional. Families differ only in the
weights they pack: an audio position embeds as the sum of K rows of one [K * V, H] table and the
audio head is a [K * V, H] matrix (v3: one tied matrix for both). An all-audio step (every decode
step) touches only attention, the audio branch, the audio embedding rows and the audio head.
Qwen3-TTS (Qwen3 layers with QK-norm, like v3) packs its own row embedding (`FastWeights.embed_rows`:
a text track and a codec track summed per row) and a one-codebook head (group 0; the family's code
predictor completes each row, engine/gpu_sampling.py).

kernels="fast" runs Triton kernels (CUDA only; a missing Triton raises `KernelUnavailable`, never
a silent fallback); kernels="ref" runs the plain-torch definitions from kernels/ on any device.

A linear weight is a tensor, or a `quantize.QuantizedWeight` (int8 or fp8 values and per-output-channel
scales) when the engine quantized the talker's backbone linears at load (`--quantize`, engine/quantize.py):
every `x @ W^T` goes through `Kernels.linear`, which runs the matching kernel (cuBLAS for bf16, Triton
for int8, per-token fp8 quantization + torch's row-wise scaled GEMM for fp8; the fp32 definitions
with kernels="ref"). Embeddings, norms and the audio head are never quantized.

RoPE tables cover `max_positions` (the engine's context cap), not the checkpoint config's
`max_position_embeddings` (2048 in the transformers-native v2 config.json; not a limit).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from higgs_stream.engine import gemv_choice, quantize
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.quantize import Weight
from higgs_stream.kernels import activation, fp8_linear, fused_norm, rope_kv
from higgs_stream.kernels._triton import KernelUnavailableError, triton_modules
from higgs_stream.kernels.rope import llama3_inv_freq

TEXT, AUDIO = 0, 1  # branches of a DualFFN layer (rows of its stacked norm weights)


class KernelUnavailable(ConfigError):
    """The requested fast kernels cannot run here (no CUDA device, no Triton or no FlashInfer)."""


class Attention(Protocol):
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Kernels:
    name: str
    add_rms_norm: Callable[..., torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rope_store_kv: Callable[..., torch.Tensor]
    linear: Callable[[torch.Tensor, Weight], torch.Tensor]  # x [N, K] @ W^T, W plain or quantized
    # the norm and SiLU writing fp8 activations for the next linear (fp8_linear.Fp8Rows); fast kernels only
    add_rms_norm_fp8: Callable[..., fp8_linear.Fp8Rows] | None = None
    silu_and_mul_fp8: Callable[[torch.Tensor], fp8_linear.Fp8Rows] | None = None

    @classmethod
    def named(cls, name: str, device: torch.device, cuda_core_gemv_rows: int = 0,
              gemv: gemv_choice.GemvChoice = gemv_choice.NONE) -> Kernels:
        """`cuda_core_gemv_rows`: quantized linears over at most this many rows on the CUDA-core GEMV (fast);
        `gemv`: which plain linears run on it (fast)."""
        if name == "ref":
            return cls("ref", fused_norm.add_rms_norm_ref, activation.silu_and_mul_ref, rope_kv.rope_store_kv_ref,
                       functools.partial(quantize.linear, kernels="ref"))
        if name != "fast":
            raise ConfigError(f"kernels must be 'fast' or 'ref', got {name!r}")
        if device.type != "cuda":
            raise KernelUnavailable(f"the fast kernels need a CUDA device, the model is on {device}; "
                                    f"pass kernels='ref' to run the plain-torch path")
        try:
            triton_modules()
        except KernelUnavailableError as exc:
            raise KernelUnavailable(str(exc)) from exc
        return cls("fast", fused_norm.add_rms_norm, activation.silu_and_mul, rope_kv.rope_store_kv,
                   functools.partial(quantize.linear, kernels="fast", cuda_core_rows=cuda_core_gemv_rows,
                                     plain=gemv.linear),
                   fused_norm.add_rms_norm_fp8,
                   activation.silu_and_mul_fp8)


@dataclass
class FastInputs:
    """One ragged step on the device. Row order = the StepBatch convention (sequence by sequence)."""

    text_ids: torch.Tensor | None  # [N] long, or None when every row is audio
    codes: torch.Tensor  # [N, K] long, 0..1025 (rows of text positions are ignored)
    positions: torch.Tensor  # [N] long
    kv_slots: torch.Tensor  # [N] long, flat page-pool slot of each row
    out_rows: torch.Tensor  # [R] long, rows whose audio logits are returned
    audio_rows: torch.Tensor | None = None  # [Na] long, for mixed steps (None: all rows audio)
    text_rows: torch.Tensor | None = None  # [Nt] long
    select: torch.Tensor | None = None  # [N] int32, 1 at audio rows (mixed steps)
    # the prompt's other tracks (family.Prompt), read only by a family that embeds its own rows
    codec_ids: torch.Tensor | None = None  # [N] long, one codec-vocabulary id per row (-1: none)
    vector_rows: torch.Tensor | None = None  # [V] long, rows that add an input vector
    vectors: torch.Tensor | None = None  # [V, H] those vectors

    @property
    def all_audio(self) -> bool:
        return self.audio_rows is None


# Defaults of the linears' options (ModelRunnerConfig documents the measurements behind them)
FUSE_FP8_QUANT = True
CUDA_CORE_GEMV_ROWS = 2
BF16_GEMV_ROWS = 4


class FastTalker:
    def __init__(self, talker: Any, kernels: str = "fast", max_positions: int = 8192,
                 fuse_fp8_quant: bool = FUSE_FP8_QUANT, cuda_core_gemv_rows: int = CUDA_CORE_GEMV_ROWS,
                 bf16_gemv_rows: int = BF16_GEMV_ROWS) -> None:
        """`talker`: any family's plain-torch talker; its `fast_weights()` packs its weights. `fuse_fp8_quant`
        (fast kernels): the norms before the QKV and gate/up projections and the SiLU before the down projection
        write their fp8 linear's per-token e4m3 activations themselves (above the weight-only GEMV's rows), in
        place of a quantization launch per linear; the same values. `cuda_core_gemv_rows`: quantized linears over
        at most this many rows (<= 4) run on the CUDA-core GEMV (ModelRunnerConfig.cuda_core_gemv_rows);
        `bf16_gemv_rows`: plain (bf16 / fp16) linears over at most this many rows (<= 4) run on it where it beats
        cuBLAS on this device, timed here per weight shape (engine/gemv_choice.py; ModelRunnerConfig.bf16_gemv_rows;
        0: never)."""
        cfg = talker.cfg
        self.cfg = cfg
        w = talker.fast_weights()
        self.device, self.dtype = w.audio_head.device, talker.dtype
        self.k = Kernels.named(kernels, self.device, cuda_core_gemv_rows)  # refuses kernels that cannot run here
        self.bf16_gemv_rows = bf16_gemv_rows if kernels == "fast" else 0
        self.gemv = gemv_choice.NONE
        if self.bf16_gemv_rows:
            self.gemv = gemv_choice.measure([*self.linear_weights(w), *w.extra_linears], self.bf16_gemv_rows,
                                            self.dtype, self.device)
            self.k = Kernels.named(kernels, self.device, cuda_core_gemv_rows, self.gemv)
        self.cuda_core_gemv_rows = cuda_core_gemv_rows if kernels == "fast" else 0
        self.fuse_fp8 = fuse_fp8_quant and self.k.add_rms_norm_fp8 is not None
        self.eps = cfg.rms_norm_eps
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.layers = w.layers
        self.quantized = any(isinstance(x, quantize.QuantizedWeight) for x in (w.layers[0].qkv, *w.layers[0].down))
        self.final_norm = w.final_norm  # [1, H]
        self.embed_text = w.embed_text  # [V, H]
        self.embed_audio = w.embed_audio  # [K*1026, H]
        self.audio_head = w.audio_head  # [K*1026, H] (v3: the same matrix as embed_audio)
        self.embed_rows = w.embed_rows  # the family's own row embedding, or None (the sum of K table rows)
        self.extra_step_bytes = w.extra_step_bytes
        self.complete_rows = (w.complete_rows(kernels, cuda_core_gemv_rows, bf16_gemv_rows)
                              if w.complete_rows is not None else None)
        self.offsets = (torch.arange(cfg.num_codebooks, device=self.device) * cfg.audio_vocab)[None]  # [1, K]
        assert max_positions >= 1, f"max_positions must be >= 1, got {max_positions}"
        inv_freq = llama3_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.max_positions = max_positions  # the engine's context cap (see the module docstring)
        self.cos_sin = rope_kv.cos_sin_table(inv_freq, self.max_positions, self.device)  # [P, D] fp32

    @staticmethod
    def linear_weights(w: FastWeights) -> list[Weight]:
        """Every layer linear's weight (both branches of a DualFFN)."""
        return [x for layer in w.layers for x in (layer.qkv, layer.o, *layer.gate_up, *layer.down)]

    # ------------------------------------------------------------------ pieces
    def embed(self, inp: FastInputs) -> torch.Tensor:
        """-> [N, H] fp32 residual stream."""
        if self.embed_rows is not None:
            return self.embed_rows(inp)
        assert inp.codec_ids is None and inp.vectors is None, "codec ids / vectors need the family's embed_rows"
        audio = self.embed_audio[inp.codes + self.offsets].float().sum(dim=1)  # [N, H]
        if inp.all_audio:
            return audio
        x = torch.zeros_like(audio)
        x[inp.audio_rows] = audio[inp.audio_rows]
        x[inp.text_rows] = self.embed_text[inp.text_ids[inp.text_rows]].float()
        return x

    def _fp8_rows(self, then: Weight | None, rows: int) -> bool:
        """Whether the kernel before the linear of `then` over `rows` rows quantizes for it (fuse_fp8_quant)."""
        return self.fuse_fp8 and then is not None and quantize.takes_fp8_rows(then, rows)

    def _norm(self, delta: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor, inp: FastInputs,
              then: Weight | None = None) -> torch.Tensor | fp8_linear.Fp8Rows:
        """weight [W, H]: W = 1 (v3), or the DualFFN pair (text, audio) chosen per row. `then`: the weight of the
        one linear that reads every output row (it may take them quantized)."""
        one = weight.shape[0] == 1 or inp.all_audio  # one norm for every row: the only one, or the audio one
        weight, select = (weight[-1:], None) if one else (weight, inp.select)
        if self._fp8_rows(then, x.shape[0]):
            return self.k.add_rms_norm_fp8(delta, x, weight, self.eps, select)
        return self.k.add_rms_norm(delta, x, weight, self.eps, select, self.dtype)

    @staticmethod
    def _one_mlp(layer: FastLayer, inp: FastInputs) -> bool:
        return len(layer.gate_up) == 1 or inp.all_audio  # one MLP for every row: the only one, or the audio one

    def _mlp(self, h: torch.Tensor | fp8_linear.Fp8Rows, layer: FastLayer, inp: FastInputs) -> torch.Tensor:
        lin = self.k.linear
        if self._one_mlp(layer, inp):
            gate_up = lin(h, layer.gate_up[-1])
            down = layer.down[-1]
            act = self.k.silu_and_mul_fp8 if self._fp8_rows(down, gate_up.shape[0]) else self.k.silu_and_mul
            return lin(act(gate_up), down)
        out = torch.empty_like(h)
        for branch, rows in ((TEXT, inp.text_rows), (AUDIO, inp.audio_rows)):
            if rows.numel():
                sub = h[rows]
                out[rows] = lin(self.k.silu_and_mul(lin(sub, layer.gate_up[branch])), layer.down[branch])
        return out

    # ------------------------------------------------------------------ forward
    def hidden(self, inp: FastInputs, attn: Attention, k_pool: torch.Tensor, v_pool: torch.Tensor,
               x: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states at `inp.out_rows`: [R, H] in the model dtype. `x`: the rows' input
        vectors [N, H] fp32 (updated in place) when the caller embedded them (Qwen3-TTS's code predictor)."""
        hq, hkv, d = self.heads
        x = self.embed(inp) if x is None else x  # [N, H] fp32
        delta = None
        for i, layer in enumerate(self.layers):
            h = self._norm(delta, x, layer.input_norm, inp, then=layer.qkv)
            qkv = self.k.linear(h, layer.qkv)  # [N, (Hq + 2 Hkv) D]
            q = self.k.rope_store_kv(qkv, inp.positions, self.cos_sin, inp.kv_slots, k_pool[i], v_pool[i], hq, hkv, d,
                                     layer.qk_norm, self.eps)  # Qwen3's QK-norm (if any) fused in
            o = attn.run(q, k_pool[i], v_pool[i])  # [N, Hq, D]
            h = self._norm(self.k.linear(o.reshape(o.shape[0], hq * d), layer.o), x, layer.post_norm, inp,
                           then=layer.gate_up[-1] if self._one_mlp(layer, inp) else None)
            delta = self._mlp(h, layer, inp)  # [N, H]
        # the last MLP's output added and every row normed in one kernel, then the output rows taken
        return self.k.add_rms_norm(delta, x, self.final_norm, self.eps, None, self.dtype)[inp.out_rows]  # [R, H]

    def audio_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R, h, audio_vocab] fp32 (bf16 weights, fp32 accumulation and output); h = K, or
        the head's codebooks of a family that completes rows (Qwen3-TTS: 1, group 0)."""
        r = hidden.shape[0]
        hidden = hidden.to(self.audio_head.dtype)  # the loader casts v3's fused matrix like the backbone; a hand-built talker may differ
        if hidden.is_cuda and hidden.dtype != torch.float32:
            logits = torch.mm(hidden, self.audio_head.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(hidden.float(), self.audio_head.float())
        return logits.view(r, -1, self.cfg.audio_vocab)

    def forward(self, inp: FastInputs, attn: Attention, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        return self.audio_logits(self.hidden(inp, attn, k_pool, v_pool))

    # ------------------------------------------------------------------ facts
    def audio_step_bytes(self) -> int:
        """Bytes of weights an all-audio decode step reads (attention, the audio branch's norms and
        MLP, QK-norms, the audio head, the final norm) plus one column's embedding rows; KV reads
        come on top. A quantized linear counts its int8/fp8 values and its scales. A family's own
        per-step weights (`FastWeights.extra_step_bytes`: Qwen3-TTS's code predictor) count too."""
        def nbytes(*ts: Weight | None) -> int:
            return sum(quantize.nbytes(t) for t in ts)

        per_layer = sum(nbytes(layer.qkv, layer.o, layer.gate_up[-1], layer.down[-1], layer.input_norm[-1],
                               layer.post_norm[-1], layer.qk_norm) for layer in self.layers)
        embed_rows = self.cfg.num_codebooks * self.cfg.hidden_size * self.embed_audio.element_size()
        return per_layer + nbytes(self.audio_head, self.final_norm) + embed_rows + self.extra_step_bytes


@dataclass
class FastLayer:
    """One layer's weights as the fast path reads them."""

    qkv: Weight  # [(Hq + 2 Hkv) D, H]
    o: Weight  # [H, Hq D]
    gate_up: tuple[Weight, ...]  # [2I, H] per branch: (text, audio) for DualFFN, (shared,) for Qwen3
    down: tuple[Weight, ...]  # [H, I] per branch
    input_norm: torch.Tensor  # [W, H], one row per branch
    post_norm: torch.Tensor  # [W, H]
    qk_norm: torch.Tensor | None = None  # [2, D] (q, k) per-head RMSNorm weights (Qwen3), else None


@dataclass
class FastWeights:
    """A talker's weights as the fast path reads them (what `talker.fast_weights()` returns)."""

    layers: list[FastLayer]
    final_norm: torch.Tensor  # [1, H]
    embed_text: torch.Tensor  # [V, H]
    embed_audio: torch.Tensor  # [K*1026, H] (Qwen3-TTS: group 0's codec table [vocab, H])
    audio_head: torch.Tensor  # [K*1026, H] (Qwen3-TTS: group 0's head [vocab, H])
    # A family whose rows are not the sum of K rows of one table embeds them itself: FastInputs -> [N, H]
    # fp32 (Qwen3-TTS: projected text track + codec id + the 16 group tables of a frame + vectors).
    embed_rows: Callable[[FastInputs], torch.Tensor] | None = None
    extra_step_bytes: int = 0  # weights a decode step reads beyond these (Qwen3-TTS: code predictor, text projection)
    # A family whose head samples fewer codebooks than a row holds: (kernels name, cuda_core_gemv_rows,
    # bf16_gemv_rows) -> its row completion on the fast path (family.RowCompleter.complete_rows' signature;
    # Qwen3-TTS: its code predictor on this stack)
    complete_rows: Callable[[str, int, int], Callable[..., torch.Tensor]] | None = None
    # the family's other plain linears a decode step runs through `FastTalker.gemv.linear` (timed with the layers';
    # Qwen3-TTS's code predictor: its input projection)
    extra_linears: tuple[torch.Tensor, ...] = ()


def fuse_linears(*linears: Any) -> Weight:
    """Concatenate Linear weights along the output axis; the modules' weights become views of it
    (quantized linears: their values and scales, `quantize.fuse`)."""
    return quantize.fuse(*linears)


def linear_weight(linear: Any) -> Weight:
    """A Linear's weight as the fast path reads it (a tensor, or its QuantizedWeight)."""
    return quantize.weight_of(linear)


def stack_norms(*norms: Any) -> torch.Tensor:
    """RMSNorm weights stacked per branch: [W, H]."""
    return torch.stack([n.weight.detach() for n in norms])  # [W, H]


def qwen3_layer(block: Any) -> FastLayer:
    """A Qwen3 decoder layer (self_attn q/k/v/o with QK-norm, one MLP) as the fast path reads it: q/k/v
    and gate/up each fused into one matrix (the module's weights become views of it). Higgs v3's talker,
    Qwen3-TTS's talker and its code predictor are all built of these."""
    attn = block.self_attn
    return FastLayer(
        qkv=fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj), o=linear_weight(attn.o_proj),
        gate_up=(fuse_linears(block.mlp.gate_proj, block.mlp.up_proj),), down=(linear_weight(block.mlp.down_proj),),
        input_norm=stack_norms(block.input_layernorm), post_norm=stack_norms(block.post_attention_layernorm),
        qk_norm=stack_norms(attn.q_norm, attn.k_norm),
    )
