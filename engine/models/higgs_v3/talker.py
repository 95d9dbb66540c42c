"""Higgs Audio v3 talker: a Qwen3 backbone with one tied fused audio matrix.

Module names follow the v3 checkpoint, so `state_dict()` keys are the checkpoint keys:
`body.layers.{i}.*` (Qwen3 layers: QK-norm, GQA, SwiGLU, no DualFFN), `body.norm.weight`,
`tied.embedding.text_embedding.weight` (text embedding, also the tied text head) and
`tied.embedding.modality_embeddings.0.embedding.weight` [8*1026, H] (the fused audio matrix: the
summed 8-codebook input embedding AND the single audio head, research/higgs_v3_peers.md §1.5-1.6).

The interface is every family's: `forward(StepBatch, KVCache) -> StepOutput`, one ragged step over
prefill chunks and decode steps. At `is_audio` positions the input embedding is the fused
embedding of `audio_codes` (reference rows in the prompt; the previous sampled row on decode
steps, whose text id is `<|audio|>`); elsewhere the text embedding of `input_ids`. The audio head
runs at each sequence's last token; the text head only for sequences with `want_text`.

Numerics (sglang-omni): the loader casts the fused matrix to the backbone dtype with everything
else; the embedding sum is taken in the matrix dtype, audio and text logits are fp32.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from higgs_stream.engine.batch import DEFAULT_MAX_POSITIONS, StepBatch, StepOutput, logits_at_rows
from higgs_stream.engine.fast_talker import FastWeights, qwen3_layer, stack_norms
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.layers import MLP, Attention, RMSNorm
from higgs_stream.engine.models.higgs_v3.config import TalkerV3Config
from higgs_stream.kernels.attention import PagedLayout
from higgs_stream.kernels.rope import llama3_inv_freq, rope_cos_sin


class Qwen3Attention(Attention):
    """The shared GQA attention (engine/layers.py) plus Qwen3's per-head RMSNorm of q and k before RoPE."""

    def __init__(self, cfg: TalkerV3Config) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(x)  # [N, Hq, D], [N, Hkv, D], [N, Hkv, D]
        return self.q_norm(q), self.k_norm(k), v


class Qwen3Layer(nn.Module):
    def __init__(self, cfg: TalkerV3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, k_pool, v_pool, layout: PagedLayout) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, k_pool, v_pool, layout)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: TalkerV3Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Qwen3Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class FusedAudio(nn.Module):
    """The tied [K*V, H] matrix: summed K-codebook embedding and the fused K-codebook head."""

    def __init__(self, num_codebooks: int, audio_vocab: int, hidden_size: int) -> None:
        super().__init__()
        self.num_codebooks, self.audio_vocab = num_codebooks, audio_vocab
        self.embedding = nn.Embedding(num_codebooks * audio_vocab, hidden_size)
        self.register_buffer("offsets", torch.arange(num_codebooks) * audio_vocab, persistent=False)  # [K]

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [N, K] long in 0..V-1 -> [N, H] in the matrix dtype (sum over codebooks)."""
        assert codes.dim() == 2 and codes.shape[1] == self.num_codebooks, f"codes {tuple(codes.shape)}"
        return F.embedding(codes + self.offsets, self.embedding.weight).sum(dim=1)  # [N, K, H] -> [N, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> [B, K, V] float32 (matmul in the matrix dtype, like the checkpoint)."""
        weight = self.embedding.weight
        out = F.linear(hidden.to(weight.dtype), weight)  # [B, K*V]
        return out.float().view(hidden.shape[0], self.num_codebooks, self.audio_vocab)


class TiedEmbedding(nn.Module):
    def __init__(self, cfg: TalkerV3Config) -> None:
        super().__init__()
        self.text_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.modality_embeddings = nn.ModuleList([FusedAudio(cfg.num_codebooks, cfg.audio_vocab, cfg.hidden_size)])


class Tied(nn.Module):
    def __init__(self, cfg: TalkerV3Config) -> None:
        super().__init__()
        self.embedding = TiedEmbedding(cfg)


class TalkerV3(nn.Module):
    """The v3 talker; `forward(StepBatch, KVCache) -> StepOutput` (engine/batch.py)."""

    def __init__(self, cfg: TalkerV3Config, *, max_positions: int = DEFAULT_MAX_POSITIONS) -> None:
        super().__init__()
        assert max_positions >= 1, f"max_positions must be >= 1, got {max_positions}"
        self.cfg = cfg
        self.max_positions = max_positions  # context cap: RoPE positions 0..max_positions-1
        self.body = Body(cfg)
        self.tied = Tied(cfg)
        self.register_buffer("inv_freq", llama3_inv_freq(cfg.head_dim, cfg.rope_theta, None), persistent=False)

    @property
    def audio(self) -> FusedAudio:
        return self.tied.embedding.modality_embeddings[0]

    @property
    def text_embedding(self) -> nn.Embedding:
        return self.tied.embedding.text_embedding

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the backbone weights (and of the KV cache); the fused audio matrix may differ."""
        return self.text_embedding.weight.dtype

    @property
    def audio_head_weight(self) -> torch.Tensor:
        """The audio head [K * audio_vocab, H]: the fused matrix, also the audio embedding."""
        return self.audio.embedding.weight

    def embed(self, input_ids: torch.Tensor, audio_codes: torch.Tensor, is_audio: torch.Tensor) -> torch.Tensor:
        """input_ids [N], audio_codes [N, K], is_audio [N] -> [N, H] in the backbone dtype.

        Branch-free (CUDA-graph friendly, like the peers' `torch.where` feedback): the fused
        embedding is taken for every row, with the codes of text rows zeroed, and selected by
        `is_audio`.
        """
        text = self.text_embedding(input_ids)  # [N, H]
        codes = torch.where(is_audio[:, None], audio_codes, torch.zeros_like(audio_codes))
        audio = self.audio.embed(codes).to(text.dtype)  # [N, H]
        return torch.where(is_audio[:, None], audio, text)

    def text_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> [B, vocab] float32 through the tied text embedding."""
        return F.linear(hidden, self.text_embedding.weight).float()

    def hidden_states(
        self, batch: StepBatch, cache: KVCache, all_layers: bool = False
    ) -> tuple[list[torch.Tensor], PagedLayout]:
        """Run the backbone over the step's N tokens (writing their K/V).

        Returns ([final-normed hidden [N, H]], layout), or with `all_layers` the embedding output
        and each layer's output before it, as transformers' `output_hidden_states` lists them.
        """
        batch.validate(self.cfg, self.max_positions)
        device = self.text_embedding.weight.device
        layout = cache.layout(batch.seq_ids, batch.qo_lens)
        x = self.embed(batch.input_ids.to(device), batch.audio_codes.to(device), batch.is_audio.to(device))  # [N, H]
        rope = rope_cos_sin(batch.positions.to(device), self.inv_freq, x.dtype)  # cos, sin [N, D]
        states = [x] if all_layers else []
        for i, layer in enumerate(self.body.layers):
            x = layer(x, rope, cache.pool.k[i], cache.pool.v[i], layout)
            if all_layers and i < len(self.body.layers) - 1:
                states.append(x)
        states.append(self.body.norm(x))
        return states, layout

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: KVCache) -> StepOutput:
        cfg = self.cfg
        states, layout = self.hidden_states(batch, cache)
        last = states[-1][layout.last_token_index]  # [B, H]
        audio_logits = logits_at_rows(self.audio.logits, last, batch.want_audio,
                                      (cfg.num_codebooks, cfg.audio_vocab))  # [B, K, V] float32
        text_logits = None
        if batch.want_text.any():  # never on v3 audio steps; kept for parity tests and text-mode callers
            text_logits = logits_at_rows(self.text_logits, last, batch.want_text, (cfg.vocab_size,))  # [B, V]
        return StepOutput(audio_logits=audio_logits, text_logits=text_logits)

    def backbone_linears(self) -> dict[str, nn.Module]:
        """The linears `--quantize` quantizes (engine/quantize.py), by module name: every layer's
        attention q/k/v/o and MLP. Not the tied audio table (embedding and head), the text
        embedding (also the text head), the QK-norms or any other norm: those stay as loaded."""
        paths = [f"self_attn.{n}" for n in Attention.LINEARS] + [f"mlp.{n}" for n in MLP.LINEARS]
        return {f"body.layers.{i}.{p}": layer.get_submodule(p) for i, layer in enumerate(self.body.layers)
                for p in paths}

    def fast_weights(self) -> FastWeights:
        """The fast path's view of these weights (engine/fast_talker.py): Qwen3, one branch per layer,
        QK-norm; the fused audio matrix is both embedding and head. q/k/v and gate/up are fused into
        one matrix each; this module's parameters become views of them (no second copy)."""
        fused = self.audio.embedding.weight.detach()
        return FastWeights(layers=[qwen3_layer(b) for b in self.body.layers], final_norm=stack_norms(self.body.norm),
                           embed_text=self.text_embedding.weight.detach(), embed_audio=fused, audio_head=fused)
