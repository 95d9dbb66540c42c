"""The Qwen3-TTS talker and code predictor in plain torch (the reference path).

    talker: a Qwen3 LM (QK-norm, GQA, SwiGLU) over positions whose input is the sum of a text track
    (text_projection(text_embedding(id)): a 2-layer MLP from the text width) and a codec track
    (codec_embedding(id), a speaker vector, or a whole frame: the sum of its 16 group embeddings);
    codec_head gives group 0's logits over the codec vocabulary (codes, then specials).
    code predictor: a small Qwen3 LM that, given the talker's last hidden state and group 0's
    embedding (2 positions), writes groups 1..15 one per step, each with its own embedding table
    (codec_embedding[g-1], talker width) and head (lm_head[g-1]); inputs pass small_to_mtp_projection
    when the widths differ. Its cache lives for one frame: a static dense buffer of positions 0..15
    (no paging), so the 15 sub-steps have fixed shapes and run inside the fast path's graphed step.

The talker's multimodal RoPE gets equal position ids in its three sections in TTS, which is plain
RoPE. Module names follow the checkpoint (`talker.model.*`, `talker.text_projection.*`,
`talker.codec_head`, `talker.code_predictor.*`), so the state dict loads without renaming.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from higgs_stream.engine.batch import StepBatch, StepOutput
from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.fast_talker import FastInputs, FastWeights, qwen3_layer, stack_norms
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.layers import MLP, Attention, RMSNorm
from higgs_stream.engine.models.qwen3_tts.config import QwenTTSConfig
from higgs_stream.kernels.attention import PagedLayout
from higgs_stream.kernels.rope import llama3_inv_freq, rope_cos_sin

Pick = Callable[[int, torch.Tensor], torch.Tensor]  # (group 1..15, logits [B, V] fp32) -> ids [B]


class _Dims:
    """What engine/layers.Attention reads from a config."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim


class QKNormAttention(Attention):
    """engine/layers.Attention plus Qwen3's per-head RMSNorm of q and k before RoPE."""

    def __init__(self, dims: _Dims, eps: float) -> None:
        super().__init__(dims)
        self.q_norm = RMSNorm(dims.head_dim, eps)
        self.k_norm = RMSNorm(dims.head_dim, eps)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project_qkv(x)
        return self.q_norm(q), self.k_norm(k), v

    def dense(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: torch.Tensor, start: int
              ) -> torch.Tensor:
        """Causal attention over a static dense cache: x [B, T, H] at positions start..start+T-1, rope
        cos/sin [T, D], cache [2, B, Hkv, S_max, D] (k, v; this step's written in place) -> [B, T, H]."""
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x.reshape(b * t, -1))
        cos, sin = rope
        q = _rotate(q.view(b, t, self.num_heads, -1), cos, sin).transpose(1, 2)  # [B, Hq, T, D]
        cache[0, :, :, start : start + t] = _rotate(k.view(b, t, self.num_kv_heads, -1), cos, sin).transpose(1, 2)
        cache[1, :, :, start : start + t] = v.view(b, t, self.num_kv_heads, -1).transpose(1, 2)
        s = start + t
        k, v = cache[0, :, :, :s], cache[1, :, :, :s]  # [B, Hkv, S, D] views
        rep = self.num_heads // self.num_kv_heads
        scores = torch.matmul(q, k.repeat_interleave(rep, 1).transpose(2, 3)) * self.head_dim ** -0.5
        causal = torch.arange(s, device=x.device)[None, :] <= torch.arange(s - t, s, device=x.device)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v.repeat_interleave(rep, 1))  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None, :]


class Qwen3Layer(nn.Module):
    def __init__(self, dims: _Dims, intermediate: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden_size, eps)
        self.self_attn = QKNormAttention(dims, eps)
        self.post_attention_layernorm = RMSNorm(dims.hidden_size, eps)
        self.mlp = MLP(dims.hidden_size, intermediate)

    def forward(self, x, rope, k_pool, v_pool, layout: PagedLayout) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, k_pool, v_pool, layout)
        return x + self.mlp(self.post_attention_layernorm(x))

    def dense(self, x, rope, cache, start):
        x = x + self.self_attn.dense(self.input_layernorm(x), rope, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextProjection(nn.Module):
    def __init__(self, cfg: QwenTTSConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size)
        self.linear_fc2 = nn.Linear(cfg.text_hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(nn.Module):
    def __init__(self, cfg: QwenTTSConfig) -> None:
        super().__init__()
        dims = _Dims(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.layers = nn.ModuleList(Qwen3Layer(dims, cfg.intermediate_size, cfg.rms_norm_eps)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class PredictorModel(nn.Module):
    def __init__(self, cfg: QwenTTSConfig) -> None:
        super().__init__()
        c = cfg.code_predictor
        dims = _Dims(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
        self.layers = nn.ModuleList(Qwen3Layer(dims, c.intermediate_size, c.rms_norm_eps) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.codebook_size, cfg.hidden_size)
                                             for _ in range(cfg.num_codebooks - 1))


class CodePredictor(nn.Module):
    def __init__(self, cfg: QwenTTSConfig) -> None:
        super().__init__()
        c = cfg.code_predictor
        self.model = PredictorModel(cfg)
        self.lm_head = nn.ModuleList(nn.Linear(c.hidden_size, cfg.codebook_size, bias=False)
                                     for _ in range(cfg.num_codebooks - 1))
        self.small_to_mtp_projection = (nn.Linear(cfg.hidden_size, c.hidden_size) if c.hidden_size != cfg.hidden_size
                                        else nn.Identity())
        self.register_buffer("inv_freq", llama3_inv_freq(c.head_dim, c.rope_theta, None), persistent=False)

    def run(self, talker_hidden: torch.Tensor, first: torch.Tensor, first_embed: torch.Tensor,
            pick: Pick) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """talker_hidden [B, H] (the talker's final-normed state where group 0 was sampled), first [B]
        (group 0) and its embedding [B, H] -> (groups 1..15 [B, 15], their logits, 15 x [B, V] fp32)."""
        x = torch.stack([talker_hidden, first_embed], dim=1)  # [B, 2, H]
        groups = len(self.lm_head)
        att = self.model.layers[0].self_attn
        # the frame's static K/V buffer: per layer k and v [B, Hkv, 1 + groups, D] (positions 0..groups)
        cache = x.new_zeros(len(self.model.layers), 2, x.shape[0], att.num_kv_heads, groups + 1, att.head_dim)
        codes, logits = [], []
        pos = 0
        for g in range(1, groups + 1):
            h = self.small_to_mtp_projection(x)
            t = h.shape[1]
            rope = rope_cos_sin(torch.arange(pos, pos + t, device=h.device), self.inv_freq, h.dtype)
            for i, layer in enumerate(self.model.layers):
                h = layer.dense(h, rope, cache[i], pos)
            pos += t
            out = self.lm_head[g - 1](self.model.norm(h[:, -1])).float()  # [B, V]
            ids = pick(g, out)
            codes.append(ids)
            logits.append(out)
            if g < len(self.lm_head):
                x = self.model.codec_embedding[g - 1](ids)[:, None]  # [B, 1, H]
        return torch.stack(codes, dim=1), logits


class Talker(nn.Module):
    """`talker.*` of the checkpoint."""

    def __init__(self, cfg: QwenTTSConfig) -> None:
        super().__init__()
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)


class QwenTTSModel(nn.Module):
    """The whole checkpoint's model (the Base variant's `speaker_encoder.*` is not built: reference audio
    reaches the prompt as a speaker vector and codes)."""

    def __init__(self, cfg: QwenTTSConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.talker = Talker(cfg)
        self.register_buffer("inv_freq", llama3_inv_freq(cfg.head_dim, cfg.rope_theta, None), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.talker.codec_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.talker.codec_head.weight.device

    # ---- the two tracks ----
    def text_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Text ids [...] -> projected text-track embeddings [..., H]."""
        return self.talker.text_projection(self.talker.model.text_embedding(ids))

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.talker.model.codec_embedding(ids)

    def frame_embed(self, frames: torch.Tensor) -> torch.Tensor:
        """Whole frames [..., 16] (codes 0..codebook_size-1) -> the sum of their 16 group embeddings [..., H]."""
        acc = self.codec_embed(frames[..., 0])
        for g, table in enumerate(self.talker.code_predictor.model.codec_embedding, start=1):
            acc = acc + table(frames[..., g])
        return acc

    # ---- the talker LM ----
    def hidden(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, seq_ids: list[int],
               qo_lens: list[int]) -> tuple[torch.Tensor, PagedLayout]:
        """Ragged step over N input embeddings [N, H] at RoPE positions [N] (their K/V written to the
        cache's reserved pages) -> final-normed hidden states [N, H]."""
        layout = cache.layout(seq_ids, qo_lens)
        rope = rope_cos_sin(positions.to(x.device), self.inv_freq, x.dtype)
        for i, layer in enumerate(self.talker.model.layers):
            x = layer(x, rope, cache.pool.k[i], cache.pool.v[i], layout)
        return self.talker.model.norm(x), layout

    def group0_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.talker.codec_head(hidden).float()  # [B, vocab]

    def complete_frames(self, hidden: torch.Tensor, first: torch.Tensor, pick: Pick
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Groups 1..15 for every row at once: hidden [B, H], group 0 [B] -> (frames [B, 16], logits)."""
        rest, logits = self.talker.code_predictor.run(hidden, first, self.codec_embed(first), pick)
        return torch.cat([first[:, None], rest], dim=1), logits

    # ---- the engine's view (engine/family.py) ----
    def embed_rows(self, batch: StepBatch) -> torch.Tensor:
        """A step's N input rows [N, H]: text track + codec track (one id, or a whole frame at
        `is_audio` rows) + the rows' vectors, summed in that order (as `prompt.embed_prompt`)."""
        cfg, dev = self.cfg, self.device
        text = batch.input_ids.to(dev)  # [N], -1: empty
        audio = batch.is_audio
        frames = batch.audio_codes[audio]
        if frames.numel() and (frames.min() < 0 or frames.max() >= cfg.codebook_size):
            raise InvalidInputError(f"frame codes must lie in 0..{cfg.codebook_size - 1}")
        if text.numel() and int(batch.input_ids.max()) >= cfg.text_vocab_size:
            raise InvalidInputError(f"text ids must lie in [0, {cfg.text_vocab_size})")
        x = torch.where((text >= 0)[:, None], self.text_embed(text.clamp(min=0)), 0.0)
        if batch.codec_ids is not None:
            if int(batch.codec_ids.max()) >= cfg.vocab_size:
                raise InvalidInputError(f"codec ids must lie in [0, {cfg.vocab_size})")
            codec = batch.codec_ids.to(dev)
            x = x + torch.where((codec >= 0)[:, None], self.codec_embed(codec.clamp(min=0)), 0.0)
        if bool(audio.any()):
            x = x + torch.where(audio.to(dev)[:, None], self.frame_embed(batch.audio_codes.to(dev)), 0.0)
        if batch.vector_rows is not None:
            x = x.index_add(0, batch.vector_rows.to(dev), batch.vectors.to(dev, x.dtype))
        return x

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: KVCache) -> StepOutput:
        """One ragged step over the batch's sequences -> group 0's logits [B, 1, V] fp32 at each
        sequence's last row (NaN where not wanted) and the final-normed hidden state there [B, H]."""
        if bool(batch.want_text.any()):
            raise InvalidInputError("the Qwen3-TTS talker has no text head")
        x = self.embed_rows(batch)  # [N, H]
        hidden, layout = self.hidden(x, batch.positions, cache, batch.seq_ids, batch.qo_lens)
        last = hidden[layout.last_token_index]  # [B, H]
        b = len(batch.seq_ids)
        logits = torch.full((b, 1, self.cfg.vocab_size), float("nan"), device=last.device)
        want = batch.want_audio.nonzero().flatten().tolist()
        if want:
            rows = torch.tensor(want, device=last.device)
            logits[rows] = self.group0_logits(last[rows])[:, None]
        return StepOutput(audio_logits=logits, text_logits=None, hidden=last)

    def complete_rows(self, hidden: torch.Tensor, head: torch.Tensor, pick: Pick) -> torch.Tensor:
        """family.RowCompleter: group 0 [S, 1] -> whole frames [S, 16] through the code predictor."""
        return self.complete_frames(hidden, head[:, 0], pick)[0]

    # ---- the fast path's view (engine/fast_talker.py) ----
    def fast_weights(self) -> FastWeights:
        """The talker LM as the fast path reads it: Qwen3 layers (one branch, QK-norm) with q/k/v and
        gate/up fused into one matrix each (this module's parameters become views of them), group 0's
        head, this talker's own row embedding (`fast_embed`), and the code predictor on the same
        stack and kernels (fast_predictor.py) that completes each row inside the graphed step."""
        m, cp = self.talker.model, self.talker.code_predictor
        # a step reads the code predictor whole (but one row of each group table) and the text projection
        tables = set(cp.model.codec_embedding.parameters())
        extra = sum(p.numel() * p.element_size() for p in [*cp.parameters(), *self.talker.text_projection.parameters()]
                    if p not in tables)
        return FastWeights(layers=[qwen3_layer(b) for b in m.layers], final_norm=stack_norms(m.norm),
                           embed_text=m.text_embedding.weight.detach(), embed_audio=m.codec_embedding.weight.detach(),
                           audio_head=self.talker.codec_head.weight.detach(), embed_rows=self.fast_embed,
                           extra_step_bytes=extra, complete_rows=self._fast_predictor)

    def _fast_predictor(self, kernels: str, cuda_core_gemv_rows: int = 0, bf16_gemv_rows: int = 0
                        ) -> Callable[..., torch.Tensor]:
        from higgs_stream.engine.models.qwen3_tts.fast_predictor import FastCodePredictor

        return FastCodePredictor(self, kernels, cuda_core_gemv_rows, bf16_gemv_rows)

    def fast_embed(self, inp: FastInputs) -> torch.Tensor:
        """`embed_rows` on device tensors, no host synchronisation: rows [N] -> [N, H] fp32, summed in
        `embed_rows`' order (text track, codec id, frame, vectors). A decode step's rows (`all_audio`)
        are each a text id and a whole frame; a prompt chunk's carry its codec ids and vectors, and
        frames at its `select` rows. Ids were checked on the host (policy.engine_prompt)."""
        text = inp.text_ids  # [N], -1: empty
        if inp.all_audio and inp.codec_ids is None:  # a decode step (graphed): every track is there
            return (self.text_embed(text) + self.frame_embed(inp.codes)).float()
        x = torch.where((text >= 0)[:, None], self.text_embed(text.clamp(min=0)), 0.0)
        if inp.codec_ids is not None:
            codec = inp.codec_ids
            x = x + torch.where((codec >= 0)[:, None], self.codec_embed(codec.clamp(min=0)), 0.0)
        audio = torch.ones_like(text, dtype=torch.bool) if inp.select is None else inp.select.bool()  # [N]
        frames = torch.where(audio[:, None], inp.codes, 0)  # codes of non-frame rows may be anything
        x = x + torch.where(audio[:, None], self.frame_embed(frames), 0.0)
        if inp.vectors is not None:
            x = x.index_add(0, inp.vector_rows, inp.vectors.to(x.dtype))
        return x.float()

    @property
    def audio_head_weight(self) -> torch.Tensor:
        """The head that samples (group 0's, [vocab, H]): what `--quantize` never touches."""
        return self.talker.codec_head.weight

    def backbone_linears(self) -> dict[str, nn.Module]:
        """The talker LM's attention q/k/v/o and MLP linears (engine/quantize.py); the code predictor,
        the embeddings, the text projection and the head stay as loaded."""
        paths = [f"self_attn.{n}" for n in Attention.LINEARS] + [f"mlp.{n}" for n in MLP.LINEARS]
        return {f"talker.model.layers.{i}.{p}": layer.get_submodule(p)
                for i, layer in enumerate(self.talker.model.layers) for p in paths}
