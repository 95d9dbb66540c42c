"""Quantize-on-load: a talker's backbone linears in int8 (weight-only) or fp8 (W8A8), the rest as loaded.

    none   every weight as loaded (bf16 on CUDA, fp32 on the CPU)
    int8   backbone linears: int8 weights, one fp32 scale per output channel; activations stay in
           the model dtype (weight-only). Any device: on the CPU ATen's int8 kernel, on CUDA a
           Triton kernel (kernels/int8_linear.py)
    fp8    backbone linears: e4m3 weights, one fp32 scale per output channel; activations quantized
           per token at run time (e4m3, one fp32 scale per row); torch's row-wise scaled GEMM
           (kernels/fp8_linear.py). CUDA with compute capability >= 8.9 (Ada, Hopper), bf16 model

Which linears are backbone linears is the family's to say: its talker's `backbone_linears()` names
them (attention q/k/v/o and the MLPs of every path: Higgs v2's text and audio DualFFN branches,
Higgs v3's Qwen3 MLP). Nothing else is touched and everything else keeps the loaded precision:
the audio embeddings, the audio head (v3: the tied fused table that is both), the text embedding
and text head, every norm, and the codec (its own fp32 module). Logits stay fp32.

Applied once, after loading and before the engine packs the fast path's fused matrices
(fast_talker.fuse_linears). The scales are per output channel, so quantizing each Linear and then
concatenating along the output axis (FastTalker's fused q/k/v and gate/up) is the same as
quantizing the fused matrix; the fused int8/fp8 matrix and its scales are the only copy, the
talker's `QuantLinear` modules view into them, as unquantized modules view into fused weights.

`kernels`: "fast" (the fast implementations above) or "ref" (the plain-torch definitions in
kernels/, fp8 emulated in fp32: any device, for tests and `--kernels ref` debugging).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import nn

from higgs_stream.engine.errors import ConfigError
from higgs_stream.kernels import fp8_linear, int8_linear

log = logging.getLogger(__name__)

MODES = ("none", "int8", "fp8")
FP8_CAPABILITY = (8, 9)  # e4m3 tensor cores: Ada (8.9) and Hopper (9.0) onwards
INT8_MAX = 127  # symmetric: -127..127
KEPT = ("audio embeddings, audio head (v3: the tied audio table), text embedding and head (logits), "
        "norms, codec")


@dataclass(frozen=True)
class QuantizedWeight:
    """A Linear weight [N, K] as stored: int8 or e4m3 values and one fp32 scale per output row."""

    mode: str  # "int8" | "fp8"
    qweight: torch.Tensor  # [N, K] int8 | float8_e4m3fn
    scale: torch.Tensor  # [N] fp32: weight ≈ qweight * scale[:, None]

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32."""
        return self.qweight.float() * self.scale[:, None]


Weight = Union[torch.Tensor, QuantizedWeight]  # what the fast path's linears hold


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"unknown quantize mode {mode!r}; expected one of {', '.join(MODES)}")
    return mode


def check_supported(mode: str, device: torch.device, dtype: torch.dtype, kernels: str = "fast") -> None:
    """ConfigError when `mode` cannot run with the fast kernels on `device` (the "ref" kernels run
    every mode anywhere)."""
    check_mode(mode)
    if mode != "fp8" or kernels == "ref":
        return
    check_fp8_device(device, "--quantize fp8", "use --quantize int8")
    if dtype != torch.bfloat16:
        raise ConfigError(f"--quantize fp8 runs with a bfloat16 model (its scaled GEMM writes bf16); got {dtype}")


def check_fp8_device(device: torch.device, what: str, instead: str = "") -> None:
    """ConfigError unless `device` is a CUDA GPU with e4m3 support (compute capability >= 8.9)."""
    need = f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}"
    tail = f": {instead}" if instead else ""
    if device.type != "cuda":
        raise ConfigError(f"{what} needs an NVIDIA GPU of compute capability >= {need} (Ada, Hopper); "
                          f"the model is on {device}{tail}")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < FP8_CAPABILITY:
        raise ConfigError(f"{what} needs compute capability >= {need} (Ada, Hopper); {device} "
                          f"({torch.cuda.get_device_name(device)}) has compute capability {cap[0]}.{cap[1]}{tail}")


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, mode: str) -> QuantizedWeight:
    """weight [N, K] float -> QuantizedWeight with one scale per output row (symmetric, max |w| maps
    to 127 or 448), computed in fp32."""
    assert weight.dim() == 2, f"weight must be [N, K], got {tuple(weight.shape)}"
    if mode == "int8":
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=fp8_linear.EPS) / INT8_MAX  # [N]
        q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        return QuantizedWeight("int8", q, scale)
    if mode == "fp8":
        q, scale = fp8_linear.quantize_rows_ref(weight.detach())
        return QuantizedWeight("fp8", q, scale)
    raise ConfigError(f"cannot quantize a weight to {mode!r}; expected int8 or fp8")


def takes_fp8_rows(w: Weight, rows: int) -> bool:
    """Whether the fast linear of `w` over `rows` rows quantizes its activations per token (fp8 above the
    weight-only GEMV's rows), so a fused kernel before it may hand it `fp8_linear.Fp8Rows` instead."""
    return isinstance(w, QuantizedWeight) and w.mode == "fp8" and rows > fp8_linear.GEMV_MAX_M


def linear(x: torch.Tensor | fp8_linear.Fp8Rows, w: Weight, kernels: str = "ref", cuda_core_rows: int = 0,
           plain: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] @ w^T -> [..., N] in x's dtype, for a plain or a quantized weight (`Fp8Rows`: an fp8 weight's
    activations already quantized, fast kernels). `cuda_core_rows` (fast kernels, CUDA): quantized weights over at
    most this many rows go through the CUDA-core GEMV (kernels/int8_linear.py `triton_gemv`; 0: never). `plain`: the
    linear of a plain weight (None: F.linear; the fast path's: engine/gemv_choice.py's choice of cuBLAS or the GEMV)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w) if plain is None else plain(x, w)
    if kernels != "fast":
        fn = int8_linear.int8_linear_ref if w.mode == "int8" else fp8_linear.fp8_linear_ref
        return fn(x, w.qweight, w.scale)
    fn = int8_linear.int8_linear if w.mode == "int8" else fp8_linear.fp8_linear
    return fn(x, w.qweight, w.scale, cuda_core_rows=cuda_core_rows)


class QuantLinear(nn.Module):
    """A bias-free Linear with a quantized weight: buffers `weight` [N, K] (int8 | e4m3) and
    `weight_scale` [N] fp32. What `quantize_talker` puts in place of a backbone nn.Linear."""

    def __init__(self, qw: QuantizedWeight, kernels: str = "fast") -> None:
        super().__init__()
        self.mode, self.kernels = qw.mode, kernels
        self.out_features, self.in_features = qw.shape
        self.register_buffer("weight", qw.qweight)
        self.register_buffer("weight_scale", qw.scale)

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.mode, self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.quantized, self.kernels)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


def weight_of(module: nn.Module) -> Weight:
    """The weight a fast-path linear reads: the module's tensor, or its QuantizedWeight."""
    if isinstance(module, QuantLinear):
        return module.quantized
    return module.weight.detach()


@torch.no_grad()
def fuse(*modules: nn.Module) -> Weight:
    """Concatenate linears along the output axis (all plain or all quantized the same way); the
    modules' weights (and scales) become views of the result: no second copy."""
    if all(isinstance(m, QuantLinear) for m in modules):
        modes = {m.mode for m in modules}
        if len(modes) != 1:
            raise ConfigError(f"cannot fuse linears quantized differently: {sorted(modes)}")
        q = torch.cat([m.weight for m in modules], dim=0).contiguous()
        s = torch.cat([m.weight_scale for m in modules], dim=0).contiguous()
        start = 0
        for m in modules:
            rows = m.out_features
            m.weight, m.weight_scale = q[start:start + rows], s[start:start + rows]
            start += rows
        return QuantizedWeight(modes.pop(), q, s)
    if any(isinstance(m, QuantLinear) for m in modules):
        raise ConfigError("cannot fuse a quantized linear with an unquantized one")
    fused = torch.cat([m.weight.detach() for m in modules], dim=0).contiguous()
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight.data = fused[start:start + rows]
        start += rows
    return fused


def nbytes(w: Weight | None) -> int:
    if w is None:
        return 0
    if isinstance(w, QuantizedWeight):
        return w.nbytes
    return w.numel() * w.element_size()


@dataclass(frozen=True)
class QuantReport:
    mode: str
    linears: int  # modules replaced
    bytes_before: int  # of their weights as loaded
    bytes_after: int  # quantized values + scales


@torch.no_grad()
def quantize_talker(talker: Any, mode: str, kernels: str = "fast") -> QuantReport:
    """Replace the family's backbone linears (`talker.backbone_linears()`) by QuantLinear, in place.

    Call it before a FastTalker packs the talker (the engine does: load, quantize, then build the
    runner). ConfigError for an unknown mode, a device the mode cannot run on (`check_supported`),
    or a family that names a layer that must stay in high precision (the audio head) or a Linear
    with a bias."""
    check_mode(mode)
    if mode == "none":
        return QuantReport(mode, 0, 0, 0)
    head = talker.audio_head_weight
    check_supported(mode, head.device, talker.dtype, kernels)
    linears = dict(talker.backbone_linears())
    before = after = 0
    for name, lin in linears.items():
        if isinstance(lin, QuantLinear):
            raise ConfigError(f"{name} is already quantized ({lin.mode})")
        if type(lin) is not nn.Linear or lin.bias is not None:
            raise ConfigError(f"{name}: only bias-free nn.Linear layers are quantized, got {lin}")
        if lin.weight.data_ptr() == head.data_ptr():
            raise ConfigError(f"{name} is the audio head: it stays in {head.dtype} (quantize.KEPT)")
        qw = quantize_weight(lin.weight, mode)
        parent, _, child = name.rpartition(".")
        setattr(talker.get_submodule(parent), child, QuantLinear(qw, kernels))
        before += nbytes(lin.weight)
        after += qw.nbytes
    report = QuantReport(mode, len(linears), before, after)
    log.info("quantized %d backbone linears to %s (%.2f GB -> %.2f GB); kept as loaded (%s): %s",
             report.linears, mode, before / 1e9, after / 1e9, talker.dtype, KEPT)
    return report
