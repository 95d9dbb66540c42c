"""The 12 Hz tokenizer's decoder as a causal stack that runs incrementally (plain torch, fp32).

    codes [B, 16, n] -> split RVQ sum [B, 512, n] -> pre_conv (causal k3) -> 8-layer sliding-window
    transformer (window 72) -> 2 x (ConvTranspose k=s=2, ConvNeXt) -> conv k7 -> 4 x (Snake,
    ConvTranspose k=2s stride s, 3 residual units k7 dilation 1/3/9) -> Snake, conv k7 -> 1 -> clamp

Every layer is causal, so a stream's state is, per layer, the few past inputs its next outputs read:
`history` samples for a convolution ((k-1)*dilation; 1 for a k=2s ConvTranspose, 0 for k=s), and
for each transformer layer the keys and values of the last window-1 frames. `step` advances a
batch of streams by n frames from their states: each layer concatenates [history | new], computes
exactly the new outputs (no padding: the history is the left padding a one-shot decode would use,
zeros at a stream's start) and keeps the last `history` inputs as the new state. One-shot decode
is one step from zero states, so a stream's outputs never depend on how its frames were chunked
beyond fp32 summation order.

Module and parameter names equal the checkpoint's (`speech_tokenizer/model.safetensors`, under
`decoder.`), so the state dict loads without renaming.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from higgs_stream.engine.codec.gemm_conv import conv1d, conv_transpose1d
from higgs_stream.engine.layers import RMSNorm  # fp32 here: the same products as rms_norm_ref's
from higgs_stream.engine.models.qwen3_tts.codec.config import QwenCodecConfig
from higgs_stream.kernels.snake import snake_beta, snake_beta_ref


# ------------------------------------------------------------------------------- pointwise parts
class Snake(nn.Module):
    """x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel (alpha, beta stored as logs)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        if x.is_cuda and x.dtype == torch.float32:
            return snake_beta(x, self.alpha, self.beta)  # one fused pass (Triton); CPU: the plain definition
        return snake_beta_ref(x, self.alpha, self.beta)


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def table(self) -> torch.Tensor:  # [size, dim]: running sums over usage counts
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _CodebookList(nn.Module):
    def __init__(self, n: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VQ(size, dim) for _ in range(n))


class _VQ(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _RVQGroup(nn.Module):
    """Codebooks whose lookups are summed, then projected (1x1 conv, no bias) to codebook_dim."""

    def __init__(self, n: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        self.vq = _CodebookList(n, size, dim)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)
        self._tables: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (key, tables, offsets)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The n tables stacked [n * size, dim] and each codebook's first row [n], made again only when
        a codebook tensor changed (loaded in place, or moved: its version or address), so a step is one
        lookup, not two divisions and a lookup per codebook."""
        books = [layer._codebook for layer in self.vq.layers]
        tensors = [t for b in books for t in (b.embedding_sum, b.cluster_usage)]
        # inference tensors (made under torch.inference_mode) keep no version: no cache for them
        key = None if any(t.is_inference() for t in tensors) else tuple((t.data_ptr(), t._version) for t in tensors)
        if key is None or self._tables is None or self._tables[0] != key:
            with torch.no_grad():
                stacked = torch.cat([b.table() for b in books])
            offsets = torch.arange(len(books), device=stacked.device) * books[0].embedding_sum.shape[0]
            self._tables = (key, stacked, offsets)
        return self._tables[1], self._tables[2]

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, n, T] -> [B, out_dim, T]
        stacked, offsets = self.tables()
        e = F.embedding(codes + offsets[:, None], stacked)  # [B, n, T, dim]
        acc = e[:, 0]
        for i in range(1, e.shape[1]):  # in codebook order, as the reference: the same sums for any chunking
            acc = acc + e[:, i]
        return conv1d(acc.transpose(1, 2), self.output_proj.weight, None)


class SplitRVQ(nn.Module):
    """Group 0 (semantic) and groups 1..15 (acoustic) each summed and projected, then added."""

    def __init__(self, cfg: QwenCodecConfig) -> None:
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.rvq_first = _RVQGroup(1, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = _RVQGroup(cfg.num_quantizers - 1, cfg.codebook_size, dim, cfg.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, Q, T] long -> [B, codebook_dim, T]
        return self.rvq_first(codes[:, :1]) + self.rvq_rest(codes[:, 1:])


# ------------------------------------------------------------------------------- causal layers
class CausalConv(nn.Module):
    """Conv1d with left-only padding; streamed with a history of (k-1)*dilation inputs."""

    def __init__(self, cin: int, cout: int, k: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, dilation=dilation, groups=groups)
        self.history = (k - 1) * dilation

    def run(self, buf: torch.Tensor) -> torch.Tensor:  # [B, Cin, H + n] -> [B, Cout, n]
        c = self.conv
        return conv1d(buf, c.weight, c.bias, dilation=c.dilation[0], groups=c.groups)


class CausalUpsample(nn.Module):
    """ConvTranspose1d(k, stride s) keeping outputs [0, n*s) of n inputs: k = s needs no history,
    k = 2s reads the previous input (history 1)."""

    def __init__(self, cin: int, cout: int, k: int, s: int) -> None:
        super().__init__()
        assert k in (s, 2 * s), f"causal upsampling supports k = s or 2s, got k={k}, s={s}"
        self.conv = nn.ConvTranspose1d(cin, cout, k, stride=s)
        self.stride = s
        self.history = k // s - 1

    def run(self, buf: torch.Tensor) -> torch.Tensor:  # [B, Cin, H + n] -> [B, Cout, n * s]
        s, h = self.stride, self.history
        y = conv_transpose1d(buf, self.conv.weight, self.conv.bias, stride=s)  # [B, Cout, (H+n+h) s]
        n = buf.shape[2] - h
        return y[:, :, h * s: (h + n) * s]


class ConvNeXt(nn.Module):
    """Depthwise causal conv k7 -> LayerNorm -> Linear x4 -> GELU -> Linear -> gamma, plus the input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))
        self.history = self.dwconv.history

    def run(self, buf: torch.Tensor) -> torch.Tensor:  # [B, C, H + n] -> [B, C, n]
        x = self.dwconv.run(buf).transpose(1, 2)  # [B, n, C]
        x = self.pwconv2(F.gelu(self.pwconv1(self.norm(x))))
        return buf[:, :, self.history:] + (self.gamma * x).transpose(1, 2)


class ResidualUnit(nn.Module):
    """x + conv1x1(snake(conv_k7_dilated(snake(x)))), causal (history 6 * dilation)."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = Snake(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = Snake(dim)
        self.conv2 = CausalConv(dim, dim, 1)
        self.history = self.conv1.history

    def run(self, buf: torch.Tensor) -> torch.Tensor:
        y = self.conv2.run(self.act2(self.conv1.run(self.act1(buf))))
        return buf[:, :, self.history:] + y


class SnakeThen(nn.Module):
    """Snake on the input, then a causal layer (the decoder blocks' Snake -> ConvTranspose, the tail's
    Snake -> conv): Snake is pointwise, so it runs over the history too."""

    def __init__(self, snake: Snake, layer: nn.Module) -> None:
        super().__init__()
        self.snake, self.layer = snake, layer
        self.history = layer.history

    def run(self, buf: torch.Tensor) -> torch.Tensor:
        return self.layer.run(self.snake(buf))


class DecoderBlock(nn.Module):
    """Snake -> ConvTranspose(2s, s) -> residual units (dilations 1, 3, 9); `block.N` as the checkpoint."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([Snake(cin), CausalUpsample(cin, cout, 2 * stride, stride),
                                    *(ResidualUnit(cout, d) for d in (1, 3, 9))])


class UpsampleStage(nn.ModuleList):
    """`upsample.N`: ConvTranspose(k = s = factor) then a ConvNeXt block."""

    def __init__(self, dim: int, factor: int) -> None:
        super().__init__([CausalUpsample(dim, dim, factor, factor), ConvNeXt(dim)])


# ------------------------------------------------------------------------------- pre-transformer
class _Scale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))


class _Attention(nn.Module):
    def __init__(self, cfg: QwenCodecConfig) -> None:
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q, bias=False)
        self.k_proj = nn.Linear(h, kv, bias=False)
        self.v_proj = nn.Linear(h, kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: QwenCodecConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: QwenCodecConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.self_attn_layer_scale = _Scale(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)
        self.mlp_layer_scale = _Scale(cfg.hidden_size)


def rope_angles(pos: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, D] of rotate-half RoPE at absolute positions pos [B, T] (once per step: every
    layer rotates at the same positions)."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d))  # [D/2]
    ang = pos.to(torch.float32)[..., None] * inv  # [B, T, D/2]
    emb = torch.cat([ang, ang], dim=-1)[:, None]  # [B, 1, T, D]
    return emb.cos(), emb.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, H, T, D] with `rope_angles`."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class PreTransformer(nn.Module):
    """Sliding-window causal transformer over frames; state per layer: K and V of the last window-1
    frames ([B, 2, kv_heads, window-1, head_dim], RoPE applied at their absolute positions)."""

    def __init__(self, cfg: QwenCodecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        self.keep = cfg.sliding_window - 1

    def state_shape(self) -> tuple[int, ...]:
        c = self.cfg
        return (c.num_hidden_layers, 2, c.num_key_value_heads, self.keep, c.head_dim)

    def run(self, x: torch.Tensor, state: torch.Tensor, start: torch.Tensor,
            valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, latent, n] at positions start + [0, n) -> ([B, latent, n], the new state: the K/V of the
        window-1 frames before start + valid)."""
        c = self.cfg
        b, _, n = x.shape
        w = self.keep
        h = self.input_proj(x.transpose(1, 2))  # [B, n, hidden]
        cols = torch.arange(n, device=x.device)
        qpos = start[:, None] + cols  # [B, n]
        kpos = torch.cat([start[:, None] - w + torch.arange(w, device=x.device), qpos], dim=1)  # [B, w + n]
        allowed = (kpos[:, None, :] <= qpos[:, :, None]) & (qpos[:, :, None] - kpos[:, None, :] < c.sliding_window) \
            & (kpos[:, None, :] >= 0)  # [B, n, w + n]
        bias = torch.zeros(allowed.shape, dtype=h.dtype, device=x.device).masked_fill(~allowed, float("-inf"))
        keep_at = valid[:, None] + torch.arange(w, device=x.device)  # [B, w]: the new state's columns
        cos, sin = rope_angles(qpos, c.head_dim, c.rope_theta)
        new_state = []
        groups = c.num_attention_heads // c.num_key_value_heads
        for layer, past in zip(self.layers, state.unbind(1)):  # past [B, 2, kvh, w, hd]
            a = layer.self_attn
            y = layer.input_layernorm(h)
            q = a.q_proj(y).view(b, n, -1, c.head_dim).transpose(1, 2)  # [B, H, n, hd]
            k = a.k_proj(y).view(b, n, -1, c.head_dim).transpose(1, 2)  # [B, kvh, n, hd]
            v = a.v_proj(y).view(b, n, -1, c.head_dim).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            keys = torch.cat([past[:, 0], k], dim=2)  # [B, kvh, w + n, hd]
            values = torch.cat([past[:, 1], v], dim=2)
            idx = keep_at[:, None, :, None].expand(-1, keys.shape[1], -1, c.head_dim)
            new_state.append(torch.stack([keys.gather(2, idx), values.gather(2, idx)], dim=1))
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=1)
                values = values.repeat_interleave(groups, dim=1)
            scores = torch.matmul(q, keys.transpose(2, 3)) * c.head_dim ** -0.5 + bias[:, None]
            att = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, H, n, hd]
            h = h + layer.self_attn_layer_scale.scale * a.o_proj(att.transpose(1, 2).reshape(b, n, -1))
            h = h + layer.mlp_layer_scale.scale * layer.mlp(layer.post_attention_layernorm(h))
        out = self.output_proj(self.norm(h)).transpose(1, 2)  # [B, latent, n]
        return out, torch.stack(new_state, dim=1)


# ------------------------------------------------------------------------------- the decoder
class QwenDecoder(nn.Module):
    """`decoder.*` of the 12 Hz tokenizer. `stages()` lists the causal layers after the transformer
    in order, each with `history` (input samples kept) and `run(buf)`; `rates()` their input rates."""

    def __init__(self, cfg: QwenCodecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.quantizer = SplitRVQ(cfg)
        self.pre_conv = CausalConv(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(UpsampleStage(cfg.latent_dim, f) for f in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList([
            CausalConv(cfg.latent_dim, cfg.decoder_dim, 7),
            *(DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
            Snake(dims[-1]),
            CausalConv(dims[-1], 1, 7),
        ])
        self._stages: list[tuple[nn.Module, int]] | None = None

    def stages(self) -> list[tuple[nn.Module, int]]:
        """(layer, input samples per frame) for every causal layer after the transformer."""
        if self._stages is None:
            out, rate = [], 1
            for up in self.upsample:
                out += [(up[0], rate)]
                rate *= up[0].stride
                out += [(up[1], rate)]
            out.append((self.decoder[0], rate))
            for blk in self.decoder[1:-2]:
                snake, convt, *units = blk.block
                out.append((SnakeThen(snake, convt), rate))
                rate *= convt.stride
                out += [(u, rate) for u in units]
            out.append((SnakeThen(self.decoder[-2], self.decoder[-1]), rate))
            self._stages = out
        return self._stages

    def receptive_frames(self) -> int:
        """Frames of left context after which a frame's samples no longer depend on earlier frames (what
        a stateless window decode must re-decode): window-1 per transformer layer, pre_conv's 2, and the
        sample-domain histories (Σ history / input rate; the real decoder: 8*71 + 2 + 10 = 580)."""
        tail = sum(layer.history / rate for layer, rate in self.stages())
        return self.cfg.num_hidden_layers * (self.cfg.sliding_window - 1) + self.pre_conv.history + math.ceil(tail)

    def state_shapes(self) -> list[tuple[int, ...]]:
        """Per-stream state shapes: pre_conv history, the transformer's K/V, then each stage's history."""
        shapes = [(self.cfg.codebook_dim, self.pre_conv.history), self.pre_transformer.state_shape()]
        for layer, _ in self.stages():
            cin = _in_channels(layer)
            shapes.append((cin, layer.history))
        return shapes

    def step(self, codes: torch.Tensor, states: list[torch.Tensor], start: torch.Tensor,
             valid: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """codes [B, Q, n] (columns >= valid[b] are junk that no kept output or state reads) at frames
        start + [0, n) -> (waveform [B, n * hop] clamped to [-1, 1], new states after start + valid)."""
        x = self.quantizer(codes)  # [B, codebook_dim, n]
        new: list[torch.Tensor] = []
        x, s = _advance(self.pre_conv, x, states[0], valid, 1)
        new.append(s)
        x, s = self.pre_transformer.run(x, states[1], start, valid)
        new.append(s)
        for (layer, rate), state in zip(self.stages(), states[2:]):
            x, s = _advance(layer, x, state, valid, rate)
            new.append(s)
        return x[:, 0].clamp(-1.0, 1.0), new


def _in_channels(layer: nn.Module) -> int:
    inner = layer.layer if isinstance(layer, SnakeThen) else layer
    if isinstance(inner, (ConvNeXt,)):
        return inner.dwconv.conv.in_channels
    if isinstance(inner, ResidualUnit):
        return inner.conv1.conv.in_channels
    return inner.conv.in_channels


def _advance(layer: nn.Module, x: torch.Tensor, state: torch.Tensor, valid: torch.Tensor,
             rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal layer over [history | x]; the new history is the `history` inputs before each row's
    valid end (valid[b] * rate new inputs)."""
    h = layer.history
    if h == 0:
        return layer.run(x), state
    buf = torch.cat([state, x], dim=2)  # [B, C, h + n_in]
    keep = valid[:, None] * rate + torch.arange(h, device=x.device)  # [B, h]
    return layer.run(buf), buf.gather(2, keep[:, None, :].expand(-1, buf.shape[1], -1))


def zero_states(decoder: QwenDecoder, batch: int, device: torch.device | str) -> list[torch.Tensor]:
    return [torch.zeros((batch, *shape), device=device) for shape in decoder.state_shapes()]


