"""The 12 Hz tokenizer as the stream side sees a codec: `geometry`, one-shot `decode`, the stateful
`streaming_decoder(max_slots)` (open / close / step / push / partition, as engine/codec/streaming.py's
StreamingDecoder), and the Base variant's audio front end: `encode` (reference audio -> codes, the
12 Hz encoder) and, when the family attached the checkpoint's speaker encoder (`speaker`),
`speaker_embedding` (reference audio -> x-vector). Both take any rate and channel count (downmixed and
resampled to 24 kHz mono as every reference clip is, engine/codec/audio_io.py) and cache their result
by content (samples + rate), up to ENCODE_CACHE_SIZE clips, least recently used evicted.

Decoding is causal: the geometry declares look-ahead 0, so the first PCM of a stream leaves with
its first frame. Always fp32; on CPU with oneDNN off (PyTorch's native convolutions), as the Higgs
codec, so a chunked decode reproduces the one-shot decode to fp32 rounding on any CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from higgs_stream.engine.codec.audio_io import DEFAULT_MAX_SECONDS, to_codec_rate, validate_waveform
from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.errors import ConfigError, InvalidInputError
from higgs_stream.engine.codec.convs import codec_convs
from higgs_stream.engine.models.qwen3_tts.codec.config import QwenCodecConfig
from higgs_stream.engine.models.qwen3_tts.codec.decoder import QwenDecoder, zero_states
from higgs_stream.engine.models.qwen3_tts.codec.encoder import EncoderConfig, QwenEncoder

if TYPE_CHECKING:
    from higgs_stream.engine.models.qwen3_tts.speaker import SpeakerEncoder

ENCODE_CACHE_SIZE = 32


class QwenCodec(nn.Module):
    def __init__(self, cfg: QwenCodecConfig, with_encoder: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.decoder = QwenDecoder(cfg)
        self.encoder: QwenEncoder | None = None
        if with_encoder:
            enc = EncoderConfig.from_json(cfg.encoder, "speech_tokenizer config.json")
            if cfg.encoder_valid_num_quantizers != cfg.num_quantizers or enc.hop != cfg.hop:
                raise ConfigError(f"the encoder keeps {cfg.encoder_valid_num_quantizers} codebooks per {enc.hop} "
                                  f"samples, the decoder reads {cfg.num_quantizers} per {cfg.hop}")
            self.encoder = QwenEncoder(enc, cfg.encoder_valid_num_quantizers)
        self.speaker: SpeakerEncoder | None = None  # a Base checkpoint's x-vector encoder (the family attaches it)
        self.allow_tf32 = False
        self.cudnn = True  # False: PyTorch's native convolutions (the codec worker's fallback, engine/gpu_memory.py)
        self._cache: OrderedDict[tuple[str, bytes], np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()
        self.requires_grad_(False)
        self.eval()

    @property
    def can_encode(self) -> bool:
        return self.encoder is not None

    @property
    def embeds_speaker(self) -> bool:
        """Whether a reference needs an x-vector too (a Base checkpoint's codec: `speaker_embedding`)."""
        return self.speaker is not None

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
        """fp32 without TF32 on CUDA; PyTorch's native convolutions on CPU (see the module docstring), and on CUDA
        with `cudnn = False` (the codec worker's fallback when a cuDNN plan disagrees with them)."""
        return codec_convs(self.device, self.allow_tf32, self.cudnn)

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

    # ---- encode (the Base variant's reference audio) ----
    def encode(self, wav: np.ndarray, sr: int, max_seconds: float = DEFAULT_MAX_SECONDS) -> np.ndarray:
        """Reference audio [T] or [C, T] at any rate -> codes int64 [16, F], F = ceil(T' / 1920) at 24 kHz."""
        if self.encoder is None:  # the family refuses a Base checkpoint without one when it loads
            raise InvalidInputError("this Qwen3-TTS checkpoint takes no reference audio: its codec has no encoder "
                                    "(speech_tokenizer without encoder.* tensors; Base checkpoints clone voices)")
        return self._cached("codes", wav, sr, max_seconds,
                            lambda x: self.encode_tensor(x)[0].cpu().numpy().astype(np.int64))  # [16, F]

    def speaker_embedding(self, wav: np.ndarray, sr: int, max_seconds: float = DEFAULT_MAX_SECONDS) -> np.ndarray:
        """Reference audio [T] or [C, T] at any rate -> the Base prompt's x-vector, float32 [hidden]."""
        if self.speaker is None:
            raise InvalidInputError("this Qwen3-TTS checkpoint takes no reference audio: no speaker encoder (only a "
                                    "Base checkpoint's codec embeds speakers)")
        speaker = self.speaker

        def embed(x: torch.Tensor) -> np.ndarray:  # [1, 1, T] -> [H]
            with self.precision():  # fp32 without TF32 on CUDA, native convs on CPU (as decode)
                return speaker.embed(x[0, 0].to(speaker.fc.weight.device)).cpu().numpy().astype(np.float32)

        return self._cached("speaker", wav, sr, max_seconds, embed)

    def _cached(self, what: str, wav: np.ndarray, sr: int, max_seconds: float,
                run: Callable[[torch.Tensor], np.ndarray]) -> np.ndarray:
        """run(mono [1, 1, T'] at 24 kHz on the codec's device) for the checked, downmixed, resampled clip;
        cached by (what, content), a copy returned."""
        checked = validate_waveform(wav, sr, max_seconds)  # [C, T] float32; AudioInputError says what is wrong
        h = hashlib.blake2b(f"{sr}:{checked.shape}".encode(), digest_size=20)
        h.update(np.ascontiguousarray(checked).tobytes())
        key = (what, h.digest())
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit.copy()
        mono = to_codec_rate(checked, sr, self.sample_rate)  # [T'] at 24 kHz
        x = torch.from_numpy(mono).to(self.device)[None, None]  # [1, 1, T']
        out = run(x)
        with self._cache_lock:
            self._cache[key] = out
            self._cache.move_to_end(key)
            while len(self._cache) > ENCODE_CACHE_SIZE:
                self._cache.popitem(last=False)
        return out.copy()

    @torch.no_grad()
    def encode_tensor(self, wav: torch.Tensor) -> torch.Tensor:
        """Encode math: mono [B, 1, T] float32 at 24 kHz -> codes [B, 16, ceil(T / 1920)] long."""
        assert self.encoder is not None, "codec built without its encoder"
        assert wav.dim() == 3 and wav.shape[1] == 1, f"wav must be [B, 1, T], got {tuple(wav.shape)}"
        with self.precision():
            return self.encoder(wav.float())
