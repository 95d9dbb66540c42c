"""The codec: batched Code2Wav decode (always fp32) and reference-audio encode (with a small LRU cache).

Submodule names equal the transformers-native checkpoint's, so that layout loads without renaming:
decode needs `quantizer.quantizers.{k}.{codebook.embed, project_out}`, `fc2`, `acoustic_decoder`;
encode adds `quantizer.quantizers.{k}.project_in`, `fc`, `acoustic_encoder`, `encoder_semantic`,
`semantic_model` (HuBERT). A codec built with `with_encoder=False` has none of the encode modules.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections import OrderedDict

import numpy as np
import torch
from higgs_stream.engine.codec.audio_io import (
    DEFAULT_MAX_SECONDS,
    to_codec_rate,
    validate_waveform,
)
from higgs_stream.engine.codec.config import CodecConfig
from higgs_stream.engine.codec.convs import codec_convs
from higgs_stream.engine.codec.decoder import AcousticDecoder
from higgs_stream.engine.codec.encoder import (
    AcousticEncoder,
    SemanticEncoder,
    align_acoustic,
    build_hubert,
    semantic_features,
)
from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.codec.quantizer import ResidualVectorQuantizer
from higgs_stream.engine.codec.streaming import lookahead_samples
from higgs_stream.engine.errors import CheckpointError, InvalidInputError
from torch import nn

ENCODE_CACHE_SIZE = 32


class Codec(nn.Module):
    def __init__(self, cfg: CodecConfig, with_encoder: bool = True, allow_tf32: bool = False):
        super().__init__()
        self.cfg = cfg
        self.allow_tf32 = allow_tf32  # opt-in speed (about 1.7x at batch 8 on H200) at ~1e-3 relative error
        self.cudnn = True  # False: PyTorch's native convolutions (the codec worker's fallback, engine/gpu_memory.py)
        # the stateful decoder's stages up to this many output samples a frame as GEMMs (None: its default, up to 1 kHz,
        # streaming.GEMM_MAX_RATE_OUT; `serve --codec-gemm-max-rate-out`, engine/codec/streaming.gemm_stage)
        self.gemm_max_rate_out: int | None = None
        self.quantizer = ResidualVectorQuantizer(cfg, with_encoder)
        self.fc2 = nn.Linear(cfg.hidden_size, cfg.acoustic_dim)
        self.acoustic_decoder = AcousticDecoder(cfg)
        self.can_encode = with_encoder
        if with_encoder:
            self.acoustic_encoder = AcousticEncoder(cfg)
            self.encoder_semantic = SemanticEncoder(cfg)
            self.semantic_model = build_hubert(cfg)
            self.fc = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.requires_grad_(False)
        self.eval()

    # ---- facts the rest of the system relies on ----
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
        return self.cfg.receptive_field

    @property
    def geometry(self) -> CodecGeometry:
        """Frame layout and look-ahead, computed from the decoder modules (what streaming needs)."""
        lookahead = lookahead_samples(self.acoustic_decoder)
        return CodecGeometry(num_codebooks=self.num_codebooks, codebook_size=self.cfg.codebook_size, hop=self.hop,
                             sample_rate=self.sample_rate, receptive_field=self.receptive_field,
                             lookahead_samples=lookahead, causal=lookahead == 0)

    @property
    def device(self) -> torch.device:
        return self.fc2.weight.device

    # ---- decode ----
    @torch.no_grad()  # not inference_mode: callers may post-process the output in place
    def decode(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor:
        """codes [B, Q, F] ints in 0..codebook_size-1 -> waveform [B, F*hop] float32 on the codec's device."""
        codes = torch.as_tensor(codes, device=self.device)
        if codes.dim() != 3 or codes.shape[1] != self.num_codebooks:
            raise InvalidInputError(f"codes must be [B, {self.num_codebooks}, F], got {tuple(codes.shape)}")
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise InvalidInputError(f"codes must be integers, got {codes.dtype}")
        batch, _, frames = codes.shape
        if frames == 0:
            return torch.zeros(batch, 0, dtype=torch.float32, device=self.device)
        codes = codes.long()
        if ((codes < 0) | (codes >= self.cfg.codebook_size)).any():
            raise InvalidInputError(f"codes must lie in 0..{self.cfg.codebook_size - 1} (got min "
                                    f"{int(codes.min())}, max {int(codes.max())}); replace stream BOS/EOS first")
        return self.decode_codes(codes)

    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Unchecked decode math: [B, Q, F] long -> [B, F*hop] float32."""
        with self.precision():
            quantized = self.quantizer.decode(codes)  # [B, H, F]
            latent = self.fc2(quantized.transpose(1, 2)).transpose(1, 2)  # [B, D, F]
            return self.acoustic_decoder(latent)[:, 0, :]  # [B, F*hop]

    def precision(self) -> contextlib.AbstractContextManager:
        """Window-invariant fp32 convolutions, so a sliding-window decode reproduces a one-shot decode.

        CUDA: cuDNN defaults to TF32 for fp32 convs, which measured 8.5e-4 max relative error on the
        full decoder (H200) against 1.6e-6 without. CPU: PyTorch's native convolution (oneDNN off;
        ~20% slower on the full decoder). Neither is bit-identical across window lengths on every
        CPU (the native conv's sgemm picks kernels by shape and vendor: 1.2e-6 of peak on AMD EPYC):
        exactness is the bound in `higgs_stream.testing`, never bit equality.
        `allow_tf32=True` opts out of both for speed. `cudnn = False`: PyTorch's native CUDA convolutions
        instead of cuDNN's (the codec worker's fallback when a cuDNN plan disagrees with them, stream/codec_worker.py).
        """
        return codec_convs(self.device, self.allow_tf32, self.cudnn)

    def streaming_decoder(self, max_slots: int):
        """The exact incremental decoder over this codec (engine/codec/streaming.py), `max_slots` streams."""
        from higgs_stream.engine.codec.streaming import StreamingDecoder

        return StreamingDecoder(self, max_slots, gemm_max_rate_out=self.gemm_max_rate_out)

    # ---- encode ----
    def encode(self, wav: np.ndarray, sr: int, max_seconds: float = DEFAULT_MAX_SECONDS) -> np.ndarray:
        """Reference audio [T] or [C, T] at any rate -> codes int64 [Q, F] (mono, resampled to 24 kHz).

        Results are cached by content (samples + rate), up to ENCODE_CACHE_SIZE entries, least recently used
        evicted; a fresh copy is returned each time.
        """
        if not self.can_encode:
            raise CheckpointError("this codec was loaded without encoder weights; it can decode but not encode "
                                  "reference audio")
        checked = validate_waveform(wav, sr, max_seconds)  # [C, T] float32
        key = _content_key(checked, sr)
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit.copy()
        mono = to_codec_rate(checked, sr, self.sample_rate)  # [T']
        x = torch.from_numpy(mono).to(self.device)[None, None, :]  # [1, 1, T']
        codes = self.encode_tensor(x)[0].cpu().numpy().astype(np.int64)  # [Q, F]
        with self._cache_lock:
            self._cache[key] = codes
            self._cache.move_to_end(key)
            while len(self._cache) > ENCODE_CACHE_SIZE:
                self._cache.popitem(last=False)
        return codes.copy()

    @torch.no_grad()
    def encode_tensor(self, wav: torch.Tensor) -> torch.Tensor:
        """Encode math: mono [B, 1, T] float32 at the codec rate -> codes [B, Q, F] long."""
        assert self.can_encode, "codec built without encoder modules"
        assert wav.dim() == 3 and wav.shape[1] == 1, f"wav must be [B, 1, T], got {tuple(wav.shape)}"
        with self.precision():
            return self._encode_math(wav)

    def _encode_math(self, wav: torch.Tensor) -> torch.Tensor:
        feats = semantic_features(self.semantic_model, wav, self.cfg)  # [B, Fs, 768]
        e_semantic = self.encoder_semantic(feats.transpose(1, 2))  # [B, 768, Fs]
        e_acoustic, e_semantic = align_acoustic(self.acoustic_encoder, wav, e_semantic, self.cfg)
        latent = torch.cat([e_acoustic, e_semantic], dim=1)  # [B, H, F]
        latent = self.fc(latent.transpose(1, 2)).transpose(1, 2)
        return self.quantizer.encode(latent)  # [B, Q, F]


def _content_key(wav: np.ndarray, sr: int) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{sr}:{wav.shape}:{wav.dtype}".encode())
    h.update(np.ascontiguousarray(wav).tobytes())
    return h.digest()
