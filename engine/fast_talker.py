"""The talker's math for the engine's fast path: fused weights, fp32 residual stream, pluggable kernels.

`FastTalker(talker, kernels="fast"|"ref")` re-packs a loaded `Talker` so that each layer's q/k/v
and each MLP's gate/up projections are one matrix (the talker's own parameters become views into
those matrices: no second copy of the weights, `state_dict()` unchanged). It runs ragged steps over
the same paged KV pool as `Talker.forward`, but takes device tensors only and returns the audio
logits of selected rows, so the engine can keep its per-stream state on the device and capture a
decode step in a CUDA graph.

Per layer, with x the fp32 residual stream and every audio row routed to the audio branch:

    h   = add_rms_norm(prev_mlp_out, x, input_norm[text|audio])      # x += prev; h bf16
    q   = rope_store_kv(h @ W_qkv)                                    # k, v -> page pool
    h   = add_rms_norm(o_proj(attention(q)), x, post_norm[text|audio])
    out = down(silu_and_mul(h @ W_gate_up))                           # text or audio MLP

An all-audio step (every decode step) touches only attention, the audio norms, `audio_mlp`, the
audio embedding rows and the audio head. kernels="fast" runs Triton kernels (CUDA only; a missing
Triton raises `KernelUnavailable`, never a silent fallback); kernels="ref" runs the plain-torch
definitions from kernels/ on any device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.talker import Talker
from higgs_stream.kernels import activation, fused_norm, rope_kv
from higgs_stream.kernels._triton import KernelUnavailableError, triton_modules
from higgs_stream.kernels.rope import llama3_inv_freq

TEXT, AUDIO = 0, 1  # rows of the stacked norm weights


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

    @classmethod
    def named(cls, name: str, device: torch.device) -> Kernels:
        if name == "ref":
            return cls("ref", fused_norm.add_rms_norm_ref, activation.silu_and_mul_ref, rope_kv.rope_store_kv_ref)
        if name != "fast":
            raise ConfigError(f"kernels must be 'fast' or 'ref', got {name!r}")
        if device.type != "cuda":
            raise KernelUnavailable(f"the fast kernels need a CUDA device, the model is on {device}; "
                                    f"pass kernels='ref' to run the plain-torch path")
        try:
            triton_modules()
        except KernelUnavailableError as exc:
            raise KernelUnavailable(str(exc)) from exc
        return cls("fast", fused_norm.add_rms_norm, activation.silu_and_mul, rope_kv.rope_store_kv)


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

    @property
    def all_audio(self) -> bool:
        return self.audio_rows is None


class FastTalker:
    def __init__(self, talker: Talker, kernels: str = "fast", max_positions: int = 8192) -> None:
        cfg = talker.cfg
        self.cfg = cfg
        head = talker.audio_lm_head.weight
        self.device, self.dtype = head.device, head.dtype
        self.k = Kernels.named(kernels, self.device)
        self.eps = cfg.rms_norm_eps
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [_fuse_layer(layer) for layer in talker.model.layers]
        self.final_norm = talker.model.norm.weight.detach()[None]  # [1, H]
        self.embed_text = talker.model.embed_tokens.weight.detach()  # [V, H]
        self.embed_audio = talker.model.embed_audio_tokens.embed_audio_tokens.weight.detach()  # [K*1026, H]
        self.offsets = (torch.arange(cfg.num_codebooks, device=self.device) * cfg.audio_vocab)[None]  # [1, K]
        self.audio_head = head.detach()  # [K*1026, H]
        inv_freq = llama3_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.max_positions = min(max_positions, cfg.max_position_embeddings)
        self.cos_sin = rope_kv.cos_sin_table(inv_freq, self.max_positions, self.device)  # [P, D] fp32

    # ------------------------------------------------------------------ pieces
    def embed(self, inp: FastInputs) -> torch.Tensor:
        """-> [N, H] fp32 residual stream."""
        audio = self.embed_audio[inp.codes + self.offsets].float().sum(dim=1)  # [N, H]
        if inp.all_audio:
            return audio
        x = torch.zeros_like(audio)
        x[inp.audio_rows] = audio[inp.audio_rows]
        x[inp.text_rows] = self.embed_text[inp.text_ids[inp.text_rows]].float()
        return x

    def _norm(self, delta: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor, inp: FastInputs) -> torch.Tensor:
        if inp.all_audio:
            return self.k.add_rms_norm(delta, x, weight[AUDIO:], self.eps, None, self.dtype)
        return self.k.add_rms_norm(delta, x, weight, self.eps, inp.select, self.dtype)

    def _mlp(self, h: torch.Tensor, layer: _Layer, inp: FastInputs) -> torch.Tensor:
        if inp.all_audio:
            return F.linear(self.k.silu_and_mul(F.linear(h, layer.gate_up[AUDIO])), layer.down[AUDIO])
        out = torch.empty_like(h)
        for branch, rows in ((TEXT, inp.text_rows), (AUDIO, inp.audio_rows)):
            if rows.numel():
                sub = h[rows]
                out[rows] = F.linear(self.k.silu_and_mul(F.linear(sub, layer.gate_up[branch])), layer.down[branch])
        return out

    # ------------------------------------------------------------------ forward
    def hidden(self, inp: FastInputs, attn: Attention, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states at `inp.out_rows`: [R, H] in the model dtype."""
        hq, hkv, d = self.heads
        x = self.embed(inp)  # [N, H] fp32
        delta = None
        for i, layer in enumerate(self.layers):
            h = self._norm(delta, x, layer.input_norm, inp)
            qkv = F.linear(h, layer.qkv)  # [N, (Hq + 2 Hkv) D]
            q = self.k.rope_store_kv(qkv, inp.positions, self.cos_sin, inp.kv_slots, k_pool[i], v_pool[i], hq, hkv, d)
            o = attn.run(q, k_pool[i], v_pool[i])  # [N, Hq, D]
            h = self._norm(F.linear(o.reshape(o.shape[0], hq * d), layer.o), x, layer.post_norm, inp)
            delta = self._mlp(h, layer, inp)  # [N, H]
        x.add_(delta.float())
        last = x[inp.out_rows]  # [R, H]
        return self.k.add_rms_norm(None, last, self.final_norm, self.eps, None, self.dtype)

    def audio_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R, K, 1026] fp32 (bf16 weights, fp32 accumulation and output)."""
        r = hidden.shape[0]
        if hidden.is_cuda and hidden.dtype != torch.float32:
            logits = torch.mm(hidden, self.audio_head.t(), out_dtype=torch.float32)
        else:
            logits = F.linear(hidden.float(), self.audio_head.float())
        return logits.view(r, self.cfg.num_codebooks, self.cfg.audio_vocab)

    def forward(self, inp: FastInputs, attn: Attention, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        return self.audio_logits(self.hidden(inp, attn, k_pool, v_pool))

    # ------------------------------------------------------------------ facts
    def audio_step_bytes(self) -> int:
        """Bytes of weights an all-audio decode step reads (attention, audio norms, audio MLP, audio
        head, the final norm) plus one column's embedding rows; KV reads come on top."""
        per_layer = sum(t.numel() * t.element_size() for layer in self.layers
                        for t in (layer.qkv, layer.o, layer.gate_up[AUDIO], layer.down[AUDIO]))
        norms = sum(2 * layer.input_norm[AUDIO].numel() * layer.input_norm.element_size() for layer in self.layers)
        esize = self.audio_head.element_size()
        head = self.audio_head.numel() * esize + self.final_norm.numel() * esize
        embed_rows = self.cfg.num_codebooks * self.cfg.hidden_size * esize
        return per_layer + norms + head + embed_rows


@dataclass
class _Layer:
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    o: torch.Tensor  # [H, Hq D]
    gate_up: tuple[torch.Tensor, torch.Tensor]  # (text, audio) [2I, H]
    down: tuple[torch.Tensor, torch.Tensor]  # (text, audio) [H, I]
    input_norm: torch.Tensor  # [2, H] (text, audio)
    post_norm: torch.Tensor  # [2, H]


@torch.no_grad()
def _fuse(*linears: Any) -> torch.Tensor:
    """Concatenate Linear weights along the output axis; the modules' weights become views of it."""
    fused = torch.cat([m.weight.detach() for m in linears], dim=0).contiguous()
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = fused[start:start + rows]
        start += rows
    return fused


def _fuse_layer(layer: Any) -> _Layer:
    attn = layer.self_attn
    return _Layer(
        qkv=_fuse(attn.q_proj, attn.k_proj, attn.v_proj),
        o=attn.o_proj.weight.detach(),
        gate_up=(_fuse(layer.mlp.gate_proj, layer.mlp.up_proj), _fuse(layer.audio_mlp.gate_proj, layer.audio_mlp.up_proj)),
        down=(layer.mlp.down_proj.weight.detach(), layer.audio_mlp.down_proj.weight.detach()),
        input_norm=torch.stack([layer.input_layernorm.weight.detach(), layer.audio_input_layernorm.weight.detach()]),
        post_norm=torch.stack([layer.post_attention_layernorm.weight.detach(),
                               layer.audio_post_attention_layernorm.weight.detach()]),
    )
