"""The Base variant's speaker encoder: reference audio -> the x-vector its prompt adds at the speaker
position (an ECAPA-TDNN over a log-mel spectrogram; plain torch, fp32).

    wav [T] at 24 kHz -> log-mel [128, M] (n_fft 1024, Hann 1024, hop 256, mels 0..12 kHz, slaney scale and
    norm; the signal reflect-padded by (n_fft - hop) / 2 each side, frames not centred; magnitude
    sqrt(re^2 + im^2 + 1e-9); log(max(x, 1e-5)))
    -> TDNN (conv k5, ReLU) -> SE-Res2Net blocks (1x1 TDNN, Res2Net of dilated k3 TDNNs, 1x1 TDNN,
    squeeze-excitation, + input) -> concat of the blocks' outputs -> TDNN -> attentive statistics
    pooling (mean and std weighted by a softmax over time) -> 1x1 conv -> [enc_dim] (= the talker's hidden size)

Every conv pads "same" by reflection. These are qwen-tts 0.1.1's `mel_spectrogram` (at the parameters
its `extract_speaker_embedding` passes) and `Qwen3TTSSpeakerEncoder`; its config is config.json's
`speaker_encoder_config`, its weights `speaker_encoder.*` in model.safetensors (our module names are
those under the prefix). The reference resamples other rates with librosa; we resample as every
reference clip is (engine/codec/audio_io.py), so a clip not at 24 kHz gets a slightly different x-vector.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from higgs_stream.engine.checkpoint_files import check_keys, read_config_json, read_headers, weight_files
from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.codec.convs import native_cpu_convs

PREFIX = "speaker_encoder."
SAMPLE_RATE = 24000
N_FFT, HOP, WIN, N_MELS, F_MIN, F_MAX = 1024, 256, 1024, 128, 0.0, 12000.0


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """config.json `speaker_encoder_config` (defaults: the reference's; enc_dim is the talker's hidden size)."""

    enc_dim: int = 1024
    mel_dim: int = N_MELS
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = SAMPLE_RATE
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        n = len(self.enc_channels)
        if n < 3 or len(self.enc_kernel_sizes) != n or len(self.enc_dilations) != n:
            raise ConfigError("speaker encoder enc_channels, enc_kernel_sizes and enc_dilations must have one "
                              "length >= 3")
        if self.mel_dim != N_MELS or self.sample_rate != SAMPLE_RATE:
            raise ConfigError(f"the speaker encoder reads {N_MELS} mel bins of {SAMPLE_RATE} Hz audio, config has "
                              f"mel_dim {self.mel_dim}, sample_rate {self.sample_rate}")
        blocks = self.enc_channels[1:-1]
        if any(c != self.enc_channels[0] for c in blocks) or self.enc_channels[0] % self.enc_res2net_scale:
            raise ConfigError("speaker encoder SE-Res2Net blocks need equal channels divisible by enc_res2net_scale")
        if sum(blocks) != self.enc_channels[-1]:
            raise ConfigError(f"speaker encoder's aggregation takes {sum(blocks)} channels, enc_channels[-1] is "
                              f"{self.enc_channels[-1]}")

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None, source: str) -> SpeakerEncoderConfig:
        raw = dict(raw or {})
        names = {f.name for f in fields(cls)} - {"extra"}
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names}
        try:
            return cls(**kw)
        except (ConfigError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: speaker_encoder_config: {e}") from e

    def to_json(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in fields(self) if f.name != "extra"}


# ------------------------------------------------------------------------------- mel front end
def slaney_mel_filters(sr: int = SAMPLE_RATE, n_fft: int = N_FFT, n_mels: int = N_MELS, fmin: float = F_MIN,
                       fmax: float = F_MAX) -> np.ndarray:
    """[n_mels, n_fft // 2 + 1] float32 triangular filters on the slaney mel scale, area-normalised
    (librosa.filters.mel's defaults, computed in float64)."""
    def to_mel(f):
        f = np.asarray(f, np.float64)
        lin = f / (200.0 / 3)
        return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0), lin)

    def to_hz(m):
        m = np.asarray(m, np.float64)
        return np.where(m >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0)), m * (200.0 / 3))

    bins = np.linspace(0, sr / 2, n_fft // 2 + 1)  # [n_freq] Hz
    edges = to_hz(np.linspace(to_mel(fmin), to_mel(fmax), n_mels + 2))  # [n_mels + 2] Hz
    width = np.diff(edges)
    ramps = edges[:, None] - bins[None, :]
    rising = -ramps[:-2] / width[:-1, None]
    falling = ramps[2:] / width[1:, None]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    filters *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return filters.astype(np.float32)


def log_mel(wav: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """wav [B, T] float32 at 24 kHz -> log-mel [B, 128, M], M = (T + 2 * 384 - 1024) // 256 + 1."""
    pad = (N_FFT - HOP) // 2
    x = F.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]
    spec = torch.stft(x, N_FFT, hop_length=HOP, win_length=WIN, window=torch.hann_window(WIN, device=wav.device),
                      center=False, normalized=False, onesided=True, return_complex=True)  # [B, 513, M]
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(filters @ mag, min=1e-5))


# ------------------------------------------------------------------------------- ECAPA-TDNN
class _TDNN(nn.Module):
    """Conv1d padded to "same" length by reflection (left: total // 2), then ReLU."""

    def __init__(self, cin: int, cout: int, k: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, dilation=dilation)
        total = dilation * (k - 1)
        self.pad = (total // 2, total - total // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad != (0, 0):
            x = F.pad(x, self.pad, mode="reflect")
        return F.relu(self.conv(x))


class _Res2Net(nn.Module):
    """Channel groups: the first passes, the second is convolved, each later one is convolved after
    adding the previous group's output."""

    def __init__(self, channels: int, scale: int, k: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        self.blocks = nn.ModuleList(_TDNN(channels // scale, channels // scale, k, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.chunk(self.scale, dim=1)
        out, prev = [parts[0]], None
        for i, part in enumerate(parts[1:]):
            prev = self.blocks[i](part if prev is None else part + prev)
            out.append(prev)
        return torch.cat(out, dim=1)


class _SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, squeeze, 1)
        self.conv2 = nn.Conv1d(squeeze, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))))  # [B, C, 1]
        return x * gate


class _SERes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se: int, k: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = _TDNN(cin, cout, 1, 1)
        self.res2net_block = _Res2Net(cout, scale, k, dilation)
        self.tdnn2 = _TDNN(cout, cout, 1, 1)
        self.se_block = _SqueezeExcite(cout, se)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


class _AttentiveStatsPool(nn.Module):
    """[B, C, M] -> [B, 2C, 1]: mean and std over time weighted by per-channel attention, whose input is
    the frames beside the plain (uniform) mean and std."""

    EPS = 1e-12

    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = _TDNN(3 * channels, attention, 1, 1)
        self.conv = nn.Conv1d(attention, channels, 1)

    @classmethod
    def _stats(cls, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (w * x).sum(dim=2)  # [B, C]
        std = torch.sqrt((w * (x - mean[:, :, None]).pow(2)).sum(dim=2).clamp(min=cls.EPS))
        return mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[2]
        mean, std = self._stats(x, torch.full_like(x[:, :1], 1.0 / m))
        context = torch.cat([x, mean[:, :, None].expand(-1, -1, m), std[:, :, None].expand(-1, -1, m)], dim=1)
        weights = self.conv(torch.tanh(self.tdnn(context))).softmax(dim=2)  # [B, C, M]
        mean, std = self._stats(x, weights)
        return torch.cat([mean, std], dim=1)[:, :, None]


class SpeakerEncoder(nn.Module):
    """Names as the checkpoint's under `speaker_encoder.`: blocks, mfa, asp, fc."""

    def __init__(self, cfg: SpeakerEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch, ks, ds = cfg.enc_channels, cfg.enc_kernel_sizes, cfg.enc_dilations
        blocks: list[nn.Module] = [_TDNN(cfg.mel_dim, ch[0], ks[0], ds[0])]
        for i in range(1, len(ch) - 1):
            blocks.append(_SERes2NetBlock(ch[i - 1], ch[i], cfg.enc_res2net_scale, cfg.enc_se_channels, ks[i], ds[i]))
        self.blocks = nn.ModuleList(blocks)
        self.mfa = _TDNN(ch[-1], ch[-1], ks[-1], ds[-1])
        self.asp = _AttentiveStatsPool(ch[-1], cfg.enc_attention_channels)
        self.fc = nn.Conv1d(2 * ch[-1], cfg.enc_dim, 1)
        self.register_buffer("mel_filters", torch.from_numpy(slaney_mel_filters()), persistent=False)
        self.requires_grad_(False)
        self.eval()

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """log-mel [B, 128, M] -> x-vectors [B, enc_dim]."""
        x, outs = mel, []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        x = self.mfa(torch.cat(outs[1:], dim=1))  # [B, C_last, M]
        return self.fc(self.asp(x))[:, :, 0]

    @torch.no_grad()
    def embed(self, wav: torch.Tensor) -> torch.Tensor:
        """Mono wav [T] float32 at 24 kHz -> x-vector [enc_dim] float32."""
        assert wav.dim() == 1, f"wav must be [T], got {tuple(wav.shape)}"
        with native_cpu_convs():  # as the codec: PyTorch's own convolutions, not oneDNN's
            return self(log_mel(wav[None].float(), self.mel_filters))[0]


def load_speaker_encoder(root: str | Path, device: str | torch.device = "cpu") -> SpeakerEncoder:
    """The Base checkpoint's speaker encoder (config.json speaker_encoder_config, speaker_encoder.* weights),
    fp32 on `device`. CheckpointError names a missing, unexpected or mis-shaped tensor."""
    root = Path(root)
    raw = read_config_json(root)
    source = str(root / "config.json")
    cfg = SpeakerEncoderConfig.from_json(raw.get("speaker_encoder_config"), source)
    hidden = (raw.get("talker_config") or {}).get("hidden_size")
    if hidden is not None and cfg.enc_dim != hidden:
        raise CheckpointError(f"{source}: speaker_encoder_config enc_dim {cfg.enc_dim} != talker hidden_size {hidden} "
                              "(the x-vector is a talker input)")
    model = SpeakerEncoder(cfg)
    files, weight_map = weight_files(root)
    entries = {k[len(PREFIX):]: e for k, e in read_headers(files, weight_map).items() if k.startswith(PREFIX)}
    params = dict(model.named_parameters())
    check_keys(params, entries, PREFIX, str(root))
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.startswith(PREFIX):
                        params[key[len(PREFIX):]].copy_(f.get_tensor(key).to(torch.float32))
    return model.to(device)

