"""The code predictor on the fast path: groups 1..15 of every row of a decode step, on FastTalker's
layer stack and kernels (fused q/k/v and gate/up, fp32 residual, QK-norm, RoPE fused with the K/V
store), graph-capturable (fixed shapes, no host synchronisation).

    x   = [talker hidden, group 0's embedding]                     # [B, 2, H]: sub-step 1, positions 0, 1
    for g in 1..15:
        h      = FastTalker(predictor).hidden(proj(x))             # the rows' last position
        ids_g  = pick(g, lm_head[g - 1](h))                        # sampled on the device
        x      = codec_embedding[g - 1](ids_g)                     # [B, 1, H]: position g + 1

Its K/V live for one frame in a static buffer [layers, B, 16, Hkv, D] that the fused RoPE + K/V
store treats as a page pool of B pages of 16 slots (stream b, position p -> slot 16 b + p);
`FrameAttention` attends over the filled prefix with the talker's paged decode kernel, the buffer read in place as
that pool (until session 23: torch's SDPA, whose call needed the buffer's prefix and the queries laid out for it).
The plain-torch `talker.CodePredictor.run` is its reference (the RefRunner's); kernels="ref" runs the same steps
with the `*_ref` kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from higgs_stream.engine.fast_talker import FastInputs, FastTalker, FastWeights, fuse_linears, qwen3_layer, stack_norms
from higgs_stream.engine.family import Pick
from higgs_stream.kernels import paged_decode


@dataclass(frozen=True)
class PredictorDims:
    """What FastTalker reads from a config, for the code predictor: its tables and heads are `groups`
    codebooks of `audio_vocab` (= codebook_size) ids each."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    num_codebooks: int  # groups 1..15: 15
    audio_vocab: int  # codebook_size
    rope_scaling: None = None


class _PredictorView:
    """The code predictor as FastTalker takes a talker: `cfg`, `dtype`, `fast_weights()`."""

    def __init__(self, model: Any) -> None:
        self.cp, c = model.talker.code_predictor, model.cfg.code_predictor
        self.cfg = PredictorDims(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.rope_theta,
                                 model.cfg.num_codebooks - 1, model.cfg.codebook_size)
        self.dtype = model.dtype

    def fast_weights(self) -> FastWeights:
        """The layers fused as the talker's; the 15 group tables and the 15 heads each fused into one
        matrix [15 * codebook_size, .] (the modules' weights become views of them)."""
        m = self.cp.model
        tables = fuse_linears(*m.codec_embedding)  # [15 * Vc, H] (nn.Embedding keeps its weight as Linear does)
        proj = self.cp.small_to_mtp_projection  # nn.Linear (1.7B) or nn.Identity (0.6B); --quantize leaves it
        return FastWeights(layers=[qwen3_layer(b) for b in m.layers], final_norm=stack_norms(m.norm), embed_text=tables,
                           embed_audio=tables, audio_head=fuse_linears(*self.cp.lm_head),  # no text rows
                           extra_linears=(proj.weight,) if isinstance(proj, torch.nn.Linear) else ())


class FrameLayout:
    """The frame buffer as a page pool, for `FrameAttention`: stream s's positions 0..n-1 on page s (its
    `[B, n, Hkv, D]` slice of every layer's buffer), each row attending to the first `lens` positions of its page.
    Built once a frame step (device tensors: the graph replays them); `csr(g)` is sub-step g's layout."""

    def __init__(self, streams: int, positions: int, device: torch.device | str) -> None:
        i32 = torch.int32
        self.b = streams
        self.indptr = torch.arange(2 * streams + 1, dtype=i32, device=device)  # one page a row
        self.pages = torch.arange(streams, dtype=i32, device=device)
        # [n, B]: a row at position p sees p + 1 positions; the first sub-step's rows (2 s, 2 s + 1) see 1 and 2
        self.lens = torch.arange(1, positions + 1, dtype=i32, device=device)[:, None].repeat(1, streams)
        # the first sub-step's pages 0, 0, 1, 1, ..: computed, not repeat_interleave'd (a tensor's repeats make the
        # host wait inside a graph capture) nor expanded (at one stream that reshape is a stride-0 view the kernel
        # reads past)
        first_pages = torch.arange(2 * streams, dtype=i32, device=device) // 2
        self.first = (self.indptr, first_pages, self.lens[:2].t().contiguous().reshape(-1))

    def csr(self, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sub-step g's (indptr, pages, lens): g = 1, two rows a stream at positions 0, 1; later one at position g."""
        return self.first if g == 1 else (self.indptr[: self.b + 1], self.pages, self.lens[g])


class FrameAttention:
    """Attention of a sub-step's rows over the frame buffer, as paged decode (kernels/paged_decode.py) over the
    `FrameLayout`: at the first sub-step the causal prefix, later every filled position. On the fast path one Triton
    program per row and K/V head reads the buffer in place (a frame's 16 positions: one block); kernels="ref": its
    plain-torch definition. Graph-capturable: the layout lives on the device."""

    BLOCK_N = 16  # tokens per block (a power of two >= 16)

    def __init__(self, csr: tuple[torch.Tensor, torch.Tensor, torch.Tensor], head_dim: int, fast: bool) -> None:
        """csr: `FrameLayout.csr(g)`, (indptr [N + 1], pages [N], lens [N]) int32."""
        self.csr, self.scale, self.fast = csr, head_dim**-0.5, fast

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], buffers [B, 16, Hkv, D] -> [N, Hq, D]."""
        if self.fast:
            return paged_decode.paged_decode(q, k_cache, v_cache, *self.csr, self.scale, block_n=self.BLOCK_N)
        return paged_decode.paged_decode_ref(q, k_cache, v_cache, *self.csr, self.scale)


class FastCodePredictor:
    """family.RowCompleter on the fast path (`FastWeights.complete_rows` of the Qwen3-TTS talker)."""

    def __init__(self, model: Any, kernels: str, cuda_core_gemv_rows: int = 0, bf16_gemv_rows: int = 0) -> None:
        self.fast = FastTalker(_PredictorView(model), kernels, max_positions=model.cfg.num_codebooks,
                               cuda_core_gemv_rows=cuda_core_gemv_rows, bf16_gemv_rows=bf16_gemv_rows)
        self.groups, self.vc = model.cfg.num_codebooks - 1, model.cfg.codebook_size
        self.codec_embed = model.codec_embed  # the talker's group-0 table
        self.proj = model.talker.code_predictor.small_to_mtp_projection

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The talker-sized inputs [B, t, H] -> [B t, Hc] fp32 (a fresh tensor: the layers update it in place)."""
        p, rows = self.proj, x.shape[0] * x.shape[1]
        if isinstance(p, torch.nn.Linear):  # the fast path's plain linear (cuBLAS or the GEMV: engine/gemv_choice.py)
            y = self.fast.gemv.linear(x.reshape(rows, -1), p.weight, p.bias)
        else:  # nn.Identity (0.6B)
            y = p(x).reshape(rows, -1)
        return y.to(torch.float32, copy=True)

    def head(self, hidden: torch.Tensor, g: int) -> torch.Tensor:
        """Group g's logits [B, Vc] fp32 (bf16 weights, fp32 accumulation and output)."""
        w = self.fast.audio_head[(g - 1) * self.vc : g * self.vc]  # [Vc, Hc]
        if hidden.is_cuda and hidden.dtype != torch.float32:
            return torch.mm(hidden, w.t(), out_dtype=torch.float32)
        return F.linear(hidden.float(), w.float())

    def __call__(self, hidden: torch.Tensor, head: torch.Tensor, pick: Pick) -> torch.Tensor:
        """hidden [B, H] (the talker's final-normed state), head [B, 1] (group 0) -> rows [B, 16]."""
        b, dev, fast, n = hidden.shape[0], hidden.device, self.fast, self.groups + 1
        _, hkv, d = fast.heads
        pool = (len(fast.layers), b, n, hkv, d)  # [L, B pages, 16 slots, Hkv, D]
        k_pool = torch.empty(pool, dtype=fast.dtype, device=dev)
        v_pool = torch.empty(pool, dtype=fast.dtype, device=dev)
        # every sub-step's row indices, built once: position p of stream s sits at slot n s + p
        streams = torch.arange(b, device=dev)
        slots = streams[:, None] * n + torch.arange(n, device=dev)  # [B, 16]
        by_position = slots.t().contiguous()  # [16, B]: row p holds position p's slots, contiguous
        positions = by_position % n  # [16, B]
        layout, fast_kernels = FrameLayout(b, n, dev), fast.k.name == "fast"
        attn = FrameAttention(layout.csr(1), d, fast_kernels)
        no_codes = torch.zeros((2 * b, 0), dtype=torch.long, device=dev)
        first = FastInputs(text_ids=None, codes=no_codes, positions=positions[:2].t().reshape(-1),
                           kv_slots=slots[:, :2].reshape(-1), out_rows=2 * streams + 1)  # positions 0, 1
        x = torch.stack([hidden, self.codec_embed(head[:, 0])], dim=1)  # [B, 2, H]
        codes, inp = [head[:, 0]], first
        for g in range(1, n):
            out = fast.hidden(inp, attn, k_pool, v_pool, x=self.project(x))  # [B, Hc]
            ids = pick(g, self.head(out, g))  # [B]
            codes.append(ids)
            x = fast.embed_audio[(g - 1) * self.vc : g * self.vc][ids][:, None]  # [B, 1, H]: group g's table (a view)
            if g + 1 < n:  # the next sub-step's one row per stream, at position g + 1
                inp = FastInputs(text_ids=None, codes=no_codes[:b], positions=positions[g + 1],
                                 kv_slots=by_position[g + 1], out_rows=streams)
                attn = FrameAttention(layout.csr(g + 1), d, fast_kernels)
        return torch.stack(codes, dim=1)  # [B, 16]
