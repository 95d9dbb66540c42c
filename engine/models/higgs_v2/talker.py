"""The Higgs Audio v2 talker: a Llama-3 backbone whose every layer is DualFFN, run as one ragged
batched step over a paged KV cache.

Per layer, each position takes the text or the audio branch of its norms and MLP; attention (and
its K/V) is shared by both:

    h = (audio ? audio_input_layernorm : input_layernorm)(x)
    x = x + self_attn(h)                        # causal over the whole sequence, llama3 RoPE
    h = (audio ? audio_post_attention_layernorm : post_attention_layernorm)(x)
    x = x + (audio ? audio_mlp : mlp)(h)

Text positions embed through `embed_tokens`; audio positions (one delay-pattern column of 8 codes
in 0..1025) through the SUM of 8 rows of one table at `code + k * 1026`. After the shared final
norm the audio head gives [8, 1026] logits (fp32) at each sequence's last new token; the text head
runs only for sequences that ask for it. Parameter names equal the transformers-native checkpoint's.

Context: RoPE is computed per position (llama3 scaling is defined for any position), so the only
position limit is the serving context cap `max_positions` (EngineConfig.max_seq_len), never the
checkpoint config's `max_position_embeddings` (2048 in the transformers-native config.json,
131072 in Boson's; both describe the same model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from higgs_stream.engine.batch import DEFAULT_MAX_POSITIONS, StepBatch, StepOutput, logits_at_rows
from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.fast_talker import FastLayer, FastWeights, fuse_linears, linear_weight, stack_norms
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.layers import MLP, Attention, RMSNorm
from higgs_stream.engine.models.higgs_v2.config import TalkerConfig
from higgs_stream.kernels.attention import PagedLayout
from higgs_stream.kernels.rope import llama3_inv_freq, rope_cos_sin


class Routing:
    """Which rows of a step are audio, computed once per step from the host mask."""

    def __init__(self, is_audio: torch.Tensor, device: torch.device) -> None:
        assert is_audio.device.type == "cpu", "routing is computed from the host copy of is_audio"
        self.num_tokens = is_audio.numel()
        self.num_audio = int(is_audio.sum())
        self.audio_rows = is_audio.nonzero().flatten().to(device)  # [Na]
        self.text_rows = (~is_audio).nonzero().flatten().to(device)  # [Nt]

    def split(
        self,
        x: torch.Tensor,
        text_fn: Callable[[torch.Tensor], torch.Tensor],
        audio_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Row-wise `audio ? audio_fn(x) : text_fn(x)`; a branch with no rows is not run."""
        if self.num_audio == self.num_tokens:
            return audio_fn(x)
        if self.num_audio == 0:
            return text_fn(x)
        out = torch.empty_like(x)
        out[self.text_rows] = text_fn(x[self.text_rows])
        out[self.audio_rows] = audio_fn(x[self.audio_rows])
        return out


class DualFFNLayer(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.audio_mlp = MLP(h, cfg.intermediate_size)
        self.audio_input_layernorm = RMSNorm(h, eps)
        self.audio_post_attention_layernorm = RMSNorm(h, eps)

    def forward(
        self,
        x: torch.Tensor,  # [N, H]
        route: Routing,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        layout: PagedLayout,
    ) -> torch.Tensor:
        h = route.split(x, self.input_layernorm, self.audio_input_layernorm)
        x = x + self.self_attn(h, rope, k_pool, v_pool, layout)
        ffn = route.split(
            x,
            lambda t: self.mlp(self.post_attention_layernorm(t)),
            lambda a: self.audio_mlp(self.audio_post_attention_layernorm(a)),
        )
        return x + ffn


class AudioEmbedding(nn.Module):
    """One [num_codebooks * audio_vocab, H] table; a column embeds as the sum of its 8 rows."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.embed_audio_tokens = nn.Embedding(cfg.num_codebooks * cfg.audio_vocab, cfg.hidden_size)
        offsets = torch.arange(cfg.num_codebooks) * cfg.audio_vocab  # [8]: k * 1026
        self.register_buffer("offsets", offsets, persistent=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.embed_audio_tokens(codes + self.offsets).sum(dim=-2)  # [N, 8] -> [N, H]


class Backbone(nn.Module):
    """Holds the `model.*` parameters (names as in the checkpoint)."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DualFFNLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embed_audio_tokens = AudioEmbedding(cfg)


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig, use_text_head: bool = True, *,
                 max_positions: int = DEFAULT_MAX_POSITIONS) -> None:
        super().__init__()
        assert max_positions >= 1, f"max_positions must be >= 1, got {max_positions}"
        self.cfg = cfg
        self.max_positions = max_positions  # context cap: RoPE positions 0..max_positions-1
        self.model = Backbone(cfg)
        self.audio_lm_head = nn.Linear(cfg.hidden_size, cfg.num_codebooks * cfg.audio_vocab, bias=False)
        self.text_lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if use_text_head else None
        inv_freq = llama3_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # [D/2] fp32
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the backbone weights (and of the KV cache the engine creates for it)."""
        return self.audio_lm_head.weight.dtype

    @property
    def audio_head_weight(self) -> torch.Tensor:
        """The audio head [K * audio_vocab, H]."""
        return self.audio_lm_head.weight

    def embed(self, input_ids: torch.Tensor, audio_codes: torch.Tensor, route: Routing) -> torch.Tensor:
        """[N] text ids, [N, 8] codes -> [N, H]; each table only looks up its own rows."""
        if route.num_audio == route.num_tokens:
            return self.model.embed_audio_tokens(audio_codes)
        if route.num_audio == 0:
            return self.model.embed_tokens(input_ids)
        x = torch.empty(route.num_tokens, self.cfg.hidden_size, dtype=self.model.embed_tokens.weight.dtype,
                        device=input_ids.device)
        x[route.text_rows] = self.model.embed_tokens(input_ids[route.text_rows])
        x[route.audio_rows] = self.model.embed_audio_tokens(audio_codes[route.audio_rows])
        return x

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: KVCache) -> StepOutput:
        cfg = self.cfg
        batch.validate(cfg, self.max_positions)
        device = self.audio_lm_head.weight.device
        dtype = self.audio_lm_head.weight.dtype
        layout = cache.layout(batch.seq_ids, batch.qo_lens)
        route = Routing(batch.is_audio, device)
        rope = rope_cos_sin(batch.positions.to(device), self.inv_freq, dtype)  # [N, D] x2

        x = self.embed(batch.input_ids.to(device), batch.audio_codes.to(device), route)  # [N, H]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, route, rope, cache.pool.k[i], cache.pool.v[i], layout)
        last = self.model.norm(x[layout.last_token_index])  # [B, H]; the final norm is per row

        audio_logits = logits_at_rows(self.audio_lm_head, last, batch.want_audio,
                                      (cfg.num_codebooks, cfg.audio_vocab))  # [B, 8, 1026]
        text_logits = None
        if batch.want_text.any():
            if self.text_lm_head is None:
                raise InvalidInputError("text logits requested from a talker built without a text head")
            text_logits = logits_at_rows(self.text_lm_head, last, batch.want_text, (cfg.vocab_size,))  # [B, V]
        return StepOutput(audio_logits=audio_logits, text_logits=text_logits)

    def backbone_linears(self) -> dict[str, nn.Module]:
        """The linears `--quantize` quantizes (engine/quantize.py), by module name: every layer's
        attention q/k/v/o and both DualFFN MLPs (text and audio). Not the audio embedding, the audio
        or text head, the text embedding or any norm: those stay as loaded."""
        paths = [f"self_attn.{n}" for n in Attention.LINEARS] + [f"{mlp}.{n}" for mlp in ("mlp", "audio_mlp")
                                                                  for n in MLP.LINEARS]
        return {f"model.layers.{i}.{p}": layer.get_submodule(p) for i, layer in enumerate(self.model.layers)
                for p in paths}

    def fast_weights(self) -> FastWeights:
        """The fast path's view of these weights (engine/fast_talker.py): DualFFN Llama-3, every layer
        with a text and an audio branch, a separate audio head. q/k/v and gate/up are fused into one
        matrix each; this module's parameters become views of them (no second copy)."""
        def layer(b: Any) -> FastLayer:
            attn = b.self_attn
            return FastLayer(
                qkv=fuse_linears(attn.q_proj, attn.k_proj, attn.v_proj), o=linear_weight(attn.o_proj),
                gate_up=(fuse_linears(b.mlp.gate_proj, b.mlp.up_proj),
                         fuse_linears(b.audio_mlp.gate_proj, b.audio_mlp.up_proj)),
                down=(linear_weight(b.mlp.down_proj), linear_weight(b.audio_mlp.down_proj)),
                input_norm=stack_norms(b.input_layernorm, b.audio_input_layernorm),
                post_norm=stack_norms(b.post_attention_layernorm, b.audio_post_attention_layernorm),
            )

        m = self.model
        return FastWeights(layers=[layer(b) for b in m.layers], final_norm=stack_norms(m.norm),
                           embed_text=m.embed_tokens.weight.detach(),
                           embed_audio=m.embed_audio_tokens.embed_audio_tokens.weight.detach(),
                           audio_head=self.audio_lm_head.weight.detach())
