"""The 12 Hz tokenizer's encoder: 24 kHz mono audio -> 16 codebooks x 2048 codes per 1920-sample frame
(what a Base request's reference audio becomes). Plain torch, fp32, one-shot (reference clips are short).

It is a Mimi encoder (the checkpoint's `encoder_config` is a transformers MimiConfig):

    wav [B, 1, T] -> SEANet conv stack (causal convs, ELU, residual units; strides 4, 5, 6, 8: 960)
    -> causal transformer (LayerNorm, RoPE, GELU MLP, layer scales) -> downsample conv (stride 2,
    replicate padding): [B, hidden, ceil(T / 1920)] -> split RVQ: the semantic quantizer (1 codebook) and
    the acoustic one (the next 15 of its codebooks), each projecting the same latent and quantizing its
    residual codebook by codebook (nearest centroid, Euclidean) -> codes [B, 16, F]

What follows qwen-tts 0.1.1 (transformers 4.57.3's MimiModel.encode, non-streaming), not the original
Mimi:
- every conv pads causally: (k-1)*dilation+1-stride samples on the left (zeros; the downsample conv
  repeats its edge) and on the right what makes the length a multiple of the stride;
- the transformer attends to every earlier frame: that MimiModel builds a full causal mask and
  ignores the config's sliding_window (250 frames, 10 s) in its eager and SDPA attention;
- the codes of an n-sample clip are the first ceil(n / 1920) frames.

Module and parameter names equal the checkpoint's under `encoder.` (speech_tokenizer/model.safetensors),
codebook buffers included (`embed_sum`, `cluster_usage`, `initialized`); the decode-side projections
(`output_proj`) and the codebooks past the 16 used (the released encoder stores 32) are loaded and
never run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.models.qwen3_tts.codec.decoder import rope, rope_angles


@dataclass(frozen=True)
class EncoderConfig:
    """The MimiConfig fields the encoder reads (defaults: transformers' MimiConfig, what the released
    tokenizer's encoder_config holds)."""

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)  # applied reversed on the way down
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    use_causal_conv: bool = True
    pad_mode: str = "constant"
    compress: int = 2
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_quantizers: int = 32
    use_conv_shortcut: bool = False
    vector_quantization_hidden_dimension: int = 256
    num_semantic_quantizers: int = 1
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    frame_rate: float = 12.5

    def __post_init__(self) -> None:
        if self.audio_channels != 1:
            raise ConfigError(f"the 12 Hz encoder takes mono audio, encoder_config has {self.audio_channels} channels")
        if not self.use_causal_conv or self.pad_mode != "constant" or self.use_conv_shortcut:
            raise ConfigError("the 12 Hz encoder port supports causal convs, constant padding and no conv shortcut "
                              f"(got use_causal_conv={self.use_causal_conv}, pad_mode={self.pad_mode!r}, "
                              f"use_conv_shortcut={self.use_conv_shortcut})")
        if self.hidden_act != "gelu" or self.attention_bias:
            raise ConfigError(f"the 12 Hz encoder port supports gelu and no attention bias, got {self.hidden_act!r}, "
                              f"attention_bias={self.attention_bias}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("encoder num_attention_heads must be a multiple of num_key_value_heads")
        if self.downsample_stride != 2:  # the reference's downsample conv has stride 2 whatever the rates
            raise ConfigError(f"encoder frame_rate {self.frame_rate} must be half its conv rate "
                              f"{self.sampling_rate / self.conv_hop:g}")

    @property
    def conv_hop(self) -> int:
        """Samples per SEANet output step (the released: 960, 25 Hz)."""
        return math.prod(self.upsampling_ratios)

    @property
    def downsample_stride(self) -> int:
        """The downsample conv's factor (the released: 25 Hz -> 12.5 Hz, 2)."""
        return int(math.ceil(self.sampling_rate / self.conv_hop) / self.frame_rate)

    @property
    def hop(self) -> int:
        return self.conv_hop * self.downsample_stride

    @classmethod
    def from_json(cls, raw: dict[str, Any], source: str) -> EncoderConfig:
        names = {f.name for f in fields(cls)}
        kw = {k: raw[k] for k in names if k in raw}
        if "upsampling_ratios" in kw:
            kw["upsampling_ratios"] = tuple(kw["upsampling_ratios"])
        rate = raw.get("frame_rate", raw.get("_frame_rate"))
        if rate is not None:
            kw["frame_rate"] = float(rate)
        if raw.get("head_dim") is None:
            kw["head_dim"] = kw.get("hidden_size", cls.hidden_size) // kw.get("num_attention_heads",
                                                                               cls.num_attention_heads)
        try:
            return cls(**kw)
        except (ConfigError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: encoder_config: {e}") from e

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "frame_rate"}
        out["upsampling_ratios"] = list(self.upsampling_ratios)
        return {**out, "model_type": "mimi", "_frame_rate": self.frame_rate, "use_streaming": False,
                "sliding_window": 250, "upsample_groups": self.hidden_size, "trim_right_ratio": 1.0}


# ------------------------------------------------------------------------------- convs
class PaddedConv(nn.Module):
    """Conv1d padded as the reference's causal MimiConv1d: left (k-1)*d+1-s, right up to a stride multiple."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, dilation: int = 1, bias: bool = True,
                 mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, stride, dilation=dilation, bias=bias)
        self.left = (k - 1) * dilation + 1 - stride
        self.stride, self.mode = stride, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, Cin, L] -> [B, Cout, ceil(L / stride)]
        n = x.shape[-1]
        right = -(-n // self.stride) * self.stride - n
        x = F.pad(x, (self.left, right), mode=self.mode)
        return self.conv(x)


class ResUnit(nn.Module):
    """x + conv1(ELU(conv_k(ELU(x)))): the SEANet residual unit (`block.1`, `block.3` are its convs)."""

    def __init__(self, dim: int, hidden: int, k: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([nn.ELU(), PaddedConv(dim, hidden, k, dilation=dilation), nn.ELU(),
                                    PaddedConv(hidden, dim, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class SEANetEncoder(nn.Module):
    """`layers`: conv, then per ratio (smallest first) residual units, ELU, strided conv; ELU, last conv."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [PaddedConv(c.audio_channels, c.num_filters, c.kernel_size)]
        dim = c.num_filters
        for ratio in reversed(c.upsampling_ratios):
            for j in range(c.num_residual_layers):
                layers.append(ResUnit(dim, dim // c.compress, c.residual_kernel_size, c.dilation_growth_rate ** j))
            layers += [nn.ELU(), PaddedConv(dim, 2 * dim, 2 * ratio, stride=ratio)]
            dim *= 2
        layers += [nn.ELU(), PaddedConv(dim, c.hidden_size, c.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 1, T] -> [B, hidden, ceil(T / conv_hop)]
        for layer in self.layers:
            x = layer(x)
        return x


# ------------------------------------------------------------------------------- transformer
class _Scale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))


class _Attention(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = (c.num_attention_heads, c.num_key_value_heads,
                                                               c.head_dim, c.rope_theta)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, F, H] -> [B, F, H], causal over all frames
        b, f, _ = x.shape
        q = self.q_proj(x).view(b, f, self.heads, self.head_dim).transpose(1, 2)  # [B, h, F, D]
        k = self.k_proj(x).view(b, f, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, f, self.kv_heads, self.head_dim).transpose(1, 2)
        pos = torch.arange(f, device=x.device)[None].expand(b, f)
        cos, sin = rope_angles(pos, self.head_dim, self.theta)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)  # [B, h, F, F]
        future = torch.ones(f, f, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.o_proj((attn @ v).transpose(1, 2).reshape(b, f, -1))


class _MLP(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.self_attn = _Attention(c)
        self.self_attn_layer_scale = _Scale(c.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(c.hidden_size, eps=c.norm_eps)
        self.mlp = _MLP(c)
        self.mlp_layer_scale = _Scale(c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale.scale * self.self_attn(self.input_layernorm(x))
        return x + self.mlp_layer_scale.scale * self.mlp(self.post_attention_layernorm(x))


class _Transformer(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, F, H]
        for layer in self.layers:
            x = layer(x)
        return x


# ------------------------------------------------------------------------------- quantizer
class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def table(self) -> torch.Tensor:  # [size, dim] centroids
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _VQ(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.codebook = _Codebook(size, dim)


class _RVQ(nn.Module):
    """Residual quantizer: project (1x1 conv) when the latent is wider than the codebooks, then per
    codebook the nearest centroid of the residual, and subtract it."""

    def __init__(self, c: EncoderConfig, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VQ(c.codebook_size, c.codebook_dim) for _ in range(n))
        self.input_proj = self.output_proj = None
        if c.vector_quantization_hidden_dimension != c.hidden_size:
            vq = c.vector_quantization_hidden_dimension
            self.input_proj = nn.Conv1d(c.hidden_size, vq, 1, bias=False)
            self.output_proj = nn.Conv1d(vq, c.hidden_size, 1, bias=False)  # decode side: stored, not run

    def encode(self, latent: torch.Tensor, n: int) -> torch.Tensor:  # [B, H, F] -> [B, n, F] long
        if self.input_proj is not None:
            latent = self.input_proj(latent)
        residual = latent.transpose(1, 2)  # [B, F, D]
        codes = []
        for vq in self.layers[:n]:
            table = vq.codebook.table()  # [K, D]
            flat = residual.reshape(-1, residual.shape[-1])  # [B*F, D]
            idx = torch.cdist(flat[None], table[None], p=2)[0].argmin(dim=-1).view(residual.shape[:2])  # [B, F]
            residual = residual - F.embedding(idx, table)
            codes.append(idx)
        return torch.stack(codes, dim=1)


class SplitRVQ(nn.Module):
    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.semantic_residual_vector_quantizer = _RVQ(c, c.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = _RVQ(c, c.num_quantizers - c.num_semantic_quantizers)
        self.num_semantic = c.num_semantic_quantizers

    def encode(self, latent: torch.Tensor, n: int) -> torch.Tensor:  # [B, H, F] -> [B, n, F]
        first = self.semantic_residual_vector_quantizer.encode(latent, self.num_semantic)
        rest = self.acoustic_residual_vector_quantizer.encode(latent, n - self.num_semantic)
        return torch.cat([first, rest], dim=1)


class QwenEncoder(nn.Module):
    """Names as the checkpoint's under `encoder.`: encoder (SEANet), encoder_transformer, downsample, quantizer."""

    def __init__(self, c: EncoderConfig, num_codebooks: int) -> None:
        super().__init__()
        if not c.num_semantic_quantizers < num_codebooks <= c.num_quantizers:
            raise ConfigError(f"the encoder keeps {num_codebooks} codebooks of its {c.num_quantizers} "
                              f"({c.num_semantic_quantizers} semantic)")
        self.cfg, self.num_codebooks = c, num_codebooks
        self.encoder = SEANetEncoder(c)
        self.encoder_transformer = _Transformer(c)
        self.downsample = PaddedConv(c.hidden_size, c.hidden_size, 2 * c.downsample_stride, stride=c.downsample_stride,
                                     bias=False, mode="replicate")
        self.quantizer = SplitRVQ(c)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        """wav [B, 1, T] float32 at 24 kHz -> codes [B, num_codebooks, ceil(T / hop)] long."""
        x = self.encoder(wav)  # [B, H, ceil(T / conv_hop)]
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        latent = self.downsample(x)  # [B, H, F']
        codes = self.quantizer.encode(latent, self.num_codebooks)  # [B, Q, F']
        return codes[:, :, : -(-wav.shape[-1] // self.cfg.hop)]
