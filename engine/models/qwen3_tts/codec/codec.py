"""The 12 Hz tokenizer as the stream side sees a codec: `geometry`, one-shot `decode`, the stateful
`streaming_decoder(max_slots)` (open / close / step / push / partition, as engine/codec/streaming.py's
StreamingDecoder) and `encode` (reference audio -> codes, the Base variant's voice prompt).

Decoding is causal: the geometry declares look-ahead 0, so the first PCM of a stream leaves with
its first frame. Always fp32; on CPU with oneDNN off (PyTorch's native convolutions), as the Higgs
codec, so a chunked decode reproduces the one-shot decode to fp32 rounding on any CPU.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.models.qwen3_tts.codec.config import QwenCodecConfig
from higgs_stream.engine.models.qwen3_tts.codec.decoder import QwenDecoder, zero_states


@contextlib.contextmanager
def _native_cpu_convs():
    previous = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = previous


class QwenCodec(nn.Module):
    def __init__(self, cfg: QwenCodecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.decoder = QwenDecoder(cfg)
        self.allow_tf32 = False
        self.can_encode = False  # the Mimi encoder is not ported yet (Base's reference audio)
        self.requires_grad_(False)
        self.eval()

    # ---- facts the stream side relies on ----
    @property
    def sample_rate(self) -> int:
        return self.cfg.sample_rate

    @property
    def hop(self) -> int:
        return self.cfg.hop

    @property
    def num_codebooks(self) -> int:
        return self.cfg.num_quantizers

    @property
    def receptive_field(self) -> int:
        return self.decoder.receptive_frames()

    @property
    def geometry(self) -> CodecGeometry:
        return CodecGeometry(num_codebooks=self.num_codebooks, codebook_size=self.cfg.codebook_size, hop=self.hop,
                             sample_rate=self.sample_rate, receptive_field=self.receptive_field,
                             lookahead_samples=0, causal=True)

    @property
    def device(self) -> torch.device:
        return self.decoder.pre_conv.conv.weight.device

    def precision(self) -> contextlib.AbstractContextManager:
        """fp32 without TF32 on CUDA; PyTorch's native convolutions on CPU (see the module docstring)."""
        if self.allow_tf32:
            return contextlib.nullcontext()
        if self.device.type != "cuda":
            return _native_cpu_convs()
        b = torch.backends.cudnn
        return b.flags(enabled=b.enabled, benchmark=b.benchmark, benchmark_limit=b.benchmark_limit,
                       deterministic=b.deterministic, allow_tf32=False)

    # ---- decode ----
    @torch.no_grad()
    def decode(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor:
        """codes [B, Q, F] ints in 0..codebook_size-1 -> waveform [B, F*hop] float32 on the codec's device."""
        codes = torch.as_tensor(codes, device=self.device)
        if codes.dim() != 3 or codes.shape[1] != self.num_codebooks:
            raise InvalidInputError(f"codes must be [B, {self.num_codebooks}, F], got {tuple(codes.shape)}")
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise InvalidInputError(f"codes must be integers, got {codes.dtype}")
        if codes.shape[2] == 0:
            return torch.zeros(codes.shape[0], 0, dtype=torch.float32, device=self.device)
        codes = codes.long()
        if ((codes < 0) | (codes >= self.cfg.codebook_size)).any():
            raise InvalidInputError(f"codes must lie in 0..{self.cfg.codebook_size - 1} (got min "
                                    f"{int(codes.min())}, max {int(codes.max())})")
        return self.decode_codes(codes)

    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Unchecked decode math: [B, Q, F] long -> [B, F*hop] float32 (one step from zero states)."""
        b, _, f = codes.shape
        start = torch.zeros(b, dtype=torch.long, device=codes.device)
        valid = torch.full((b,), f, dtype=torch.long, device=codes.device)
        with torch.no_grad(), self.precision():
            wav, _ = self.decoder.step(codes, zero_states(self.decoder, b, codes.device), start, valid)
        return wav

    def streaming_decoder(self, max_slots: int):
        """The exact stateful decoder over this codec (streaming.py), `max_slots` streams."""
        from higgs_stream.engine.models.qwen3_tts.codec.streaming import QwenStreamingDecoder

        return QwenStreamingDecoder(self, max_slots)

    # ---- encode ----
    def encode(self, wav: np.ndarray, sr: int, max_seconds: float | None = None) -> np.ndarray:
        raise InvalidInputError("encoding reference audio with the Qwen3-TTS 12 Hz tokenizer is not supported yet; "
                                "pass reference codes (and the speaker embedding) through the Python API")
