"""Counter-based exponential noise for batched sampling: row b's noise depends only on
(seeds[b], counters[b]) and the element index, never on the batch it shares.

    key[b]      = mix(mix(seed_lo ^ mix(seed_hi ^ C)) ^ counter_lo)
    bits[b, e]  = mix(key[b] ^ mix(e + 1))                  (32-bit, e = flat index in [0, n))
    noise[b, e] = -log(((bits >> 9) + 0.5) / 2^23)          (Exp(1), never 0 or inf)

23 bits, not 24: (2^24 - 1) + 0.5 is not an fp32 number and rounds up to 2^24, so the 24-bit form
gave uniform = 1 and noise = 0 for one element in 2^24; in the race p / noise a zero-probability id
with zero noise is 0 / 0 = NaN, which argmax picks (a suppressed Qwen3-TTS special id was sampled
that way, about once per 35 M draws on an H100). With 23 bits every value is exact: uniform lies in
[2^-24, 1 - 2^-24], noise in [6e-8, 16.7].

`mix` is the 32-bit "lowbias32" integer hash (xorshift-multiply). A categorical draw is then
argmax(p / noise) (the exponential race), as in engine/sampling.py. `exp_noise_ref` computes it
with int64 torch ops on any device; `exp_noise` is the Triton kernel (same bits on CUDA).
"""

from __future__ import annotations

import functools

import torch

from higgs_stream.kernels._triton import pdl_args, require_cuda, triton_modules

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x846CA68B
_SEED_SALT = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def row_keys_ref(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """seeds [B] int64 (0..2^63), counters [B] int64 -> [B] int64 keys in [0, 2^32)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    return _mix32(_mix32(lo ^ _mix32(hi ^ _SEED_SALT)) ^ (counters & _M32))


def exp_noise_ref(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """-> [B, n] float32 Exp(1) variates."""
    assert seeds.shape == counters.shape and seeds.dim() == 1, "seeds/counters must be [B]"
    keys = row_keys_ref(seeds.long(), counters.long())  # [B]
    elem = _mix32(torch.arange(1, n + 1, device=seeds.device, dtype=torch.long))  # [n]
    return exp_from_bits(_mix32(keys[:, None] ^ elem[None, :]))  # [B, n]


def exp_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> float32 Exp(1) variates in [6e-8, 16.7] (the kernel's formula)."""
    uniform = ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))
    return -torch.log(uniform)


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def mix32(x):  # int64 x in [0, 2^32); each product split in 16-bit halves: no int64 overflow
        x = x ^ (x >> 16)
        x = (x * 0x352D + (((x * 0x7FEB) & 0xFFFF) << 16)) & 0xFFFFFFFF  # x * 0x7FEB352D mod 2^32
        x = x ^ (x >> 15)
        x = (x * 0xA68B + (((x * 0x846C) & 0xFFFF) << 16)) & 0xFFFFFFFF  # x * 0x846CA68B mod 2^32
        return x ^ (x >> 16)

    @triton.jit
    def exp_noise_kernel(seed_ptr, counter_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        seed = tl.load(seed_ptr + row)
        counter = tl.load(counter_ptr + row)
        lo = seed & 0xFFFFFFFF
        hi = (seed >> 32) & 0xFFFFFFFF
        key = mix32(mix32(lo ^ mix32(hi ^ 0x9E3779B9)) ^ (counter & 0xFFFFFFFF))
        bits = mix32(key ^ mix32(offs.to(tl.int64) + 1))
        uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        tl.store(out_ptr + row * n + offs, -tl.log(uniform), mask=mask)

    return triton, exp_noise_kernel


def exp_noise(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """Triton version of `exp_noise_ref` (int64 CUDA tensors)."""
    assert seeds.shape == counters.shape and seeds.dim() == 1, "seeds/counters must be [B]"
    assert seeds.dtype == torch.long and counters.dtype == torch.long, "seeds/counters must be int64"
    assert seeds.is_contiguous() and counters.is_contiguous(), "seeds/counters: read by element offsets"
    require_cuda(seeds, counters, what="exp_noise")
    triton, kernel = _kernel()
    out = torch.empty((seeds.shape[0], n), dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        block = 1024
        kernel[(seeds.shape[0], triton.cdiv(n, block))](seeds, counters, out, n, BLOCK=block, **pdl_args(), num_warps=4)
    return out
