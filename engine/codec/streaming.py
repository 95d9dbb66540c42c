"""Exact incremental Code2Wav: every latent frame goes through every decoder layer once.

The Higgs decoder is non-causal (each layer zero-pads both ends), so a sliding window must re-decode
10 frames on each side. `StreamingDecoder` instead keeps, per stream and per layer, the few input
samples the next outputs still need, and emits each output sample as soon as every input it reads
exists. Its concatenated output equals the one-shot `Codec.decode` of the whole utterance up to fp32
rounding; it lags the pushed frames by `geometry.lookahead_samples` (9458 samples = 9.85 frames).

Per layer (fp32, the codec's own weights, convolutions WITHOUT padding, Snake via the codec's modules):
- "same" conv (k, dilation d, padding p = (k-1)d/2): history = the last 2p inputs; buf = [history | new n]
  gives n outputs, p samples behind the inputs.
- ConvTranspose1d (k = 2s, stride s, padding p): history = the last input; conv_transpose1d of
  [prev | new n] with no padding, keep [s, s + n*s): n*s outputs that no later input changes, p behind.
- ResidualUnit (dilation d): one history of its input (6d samples);
  output = buf[3d : 3d+n] + conv2(snake(conv1(snake(buf)))), 3d behind.
Edges: one-shot zero-pads every layer's input, so outputs at positions < 0 (warm-up from the zero
histories) or >= the layer's true length (once the last frame is known) are set to 0 before they feed
the next layer, and latent frames >= F are 0. A final push runs `lookahead_frames` masked padding frames
through the stack so every real sample comes out.

State lives in a slot arena: `states[i]` is [max_slots + 1, C_i, H_i] on the codec's device (the last
slot is scratch for padding rows). One batched step gathers the rows' histories by slot index, runs the
stack over a fixed [B, Q, C] shape, and scatters the new histories back; row b advances by its own
`valid[b] <= C` frames (columns beyond are junk that never reaches a state: the new history is gathered
at the row's own offset). A stream whose position is 0 reads zeros, so `open()` needs no device work.
Positions, lengths and slots are plain Python; the device sees four index vectors per step.

API:
    dec = StreamingDecoder(codec, max_slots)
    dec.geometry                        CodecGeometry (hop, lookahead_samples, lookahead_frames, ...)
    slot = dec.open()                   CapacityError when all slots are taken
    dec.close(slot)
    dec.free_slots, dec.state_bytes_per_stream
    dec.push(slots, codes, valid, final) -> list[Tensor]
        codes [B, Q, >= max(valid)] ints (CPU or device; columns beyond valid[b] ignored); returns per row
        the NEW samples [n_b] float32 on the device: output positions [emitted, min(frames*hop - lookahead,
        F*hop)); after final[b] the row's outputs concatenate to `codec.decode(all its frames)`.
    dec.step(slots, codes, valid, final) -> StepAudio(audio [B', C*hop], offsets, counts)
        the same step as one device tensor (B' >= B: padding rows follow); row b's new samples are
        audio[b, offsets[b] : offsets[b] + counts[b]] (convert all rows to s16 in one op, copy once).
    dec.capture(batch_buckets, frame_buckets, graphs=True) -> float
        CUDA graphs per (B, C) bucket, checked against the eager step; push/step then pad to the smallest
        bucket that holds them and replay; other shapes run eagerly. A final push needs valid +
        lookahead_frames columns, so give frame buckets that hold it. graphs=False: pad, run eagerly.
        With graphs, every bucket's replay is timed (`step_cost`).
    dec.partition(slots, valid, final) -> list[list[int]]
        the rows of one push split into steps that cost least in total: a step pads every row to its
        widest, so a 1-frame row beside a final 35-frame push costs 35 frames; each extra step costs a
        launch. Rows are sorted by width and cut between frame buckets where that is cheaper, priced by
        `step_cost(rows, width)` (the timed replay of the bucket, else the STEP_* model).
The tensors push/step return may be views of a buffer that the next push/step overwrites (a graph's
output): copy or convert them before the next call. Codes given on the device are range-checked with
one device reduction (a host sync); CPU codes are checked on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from higgs_stream.engine.codec.arena import SlotArenaDecoder
from higgs_stream.engine.codec.decoder import AcousticDecoder
from higgs_stream.engine.codec.gemm_conv import conv1d_gemm, conv_transpose1d_gemm
from higgs_stream.engine.codec.layers import ResidualUnit, Snake1d
from higgs_stream.engine.codec.step_graphs import (
    CAPTURE_TOLERANCE,
    TIMED_REPLAYS,
    replay_diff,
    split_inputs,
)
from higgs_stream.engine.errors import ConfigError, InvalidInputError
from torch import nn

if TYPE_CHECKING:
    from higgs_stream.engine.codec.codec import Codec

OPEN_END = 1 << 40  # "length not known yet" (frames); times any rate still fits int64
# CAPTURE_TOLERANCE and TIMED_REPLAYS live in step_graphs.py (shared with the Qwen3-TTS decoder); exported here too
__all__ = ["CAPTURE_TOLERANCE", "TIMED_REPLAYS", "StepAudio", "StreamingDecoder", "lookahead_samples", "plan"]


# ---------------------------------------------------------------------------- the layer plan
@dataclass(frozen=True)
class Stage:
    """One decoder layer as the incremental decoder runs it."""

    kind: Literal["conv", "conv_t", "res"]
    module: nn.Module  # Conv1d, ConvTranspose1d or ResidualUnit
    snake: Snake1d | None  # applied to the layer's input first (conv, conv_t)
    channels: int  # input channels (= history channels)
    history: int  # input samples kept per stream
    rate_in: int  # input samples per frame
    rate_out: int  # output samples per frame
    lag: int  # output j of a step starting at frame a sits at position a * rate_out - lag + j


def _same_pad(m: nn.Conv1d) -> int:
    k, d, p = m.kernel_size[0], m.dilation[0], m.padding
    if not (isinstance(p, tuple) and m.stride[0] == 1 and m.groups == 1 and (k - 1) * d == 2 * p[0]):
        raise ConfigError(f"streaming decode needs stride-1 'same' convs, got {m}")
    return p[0]


def plan(decoder: AcousticDecoder) -> list[Stage]:
    """The decoder's layers in order, with the history each keeps and the lag it adds."""
    stages: list[Stage] = []
    rate, lag = 1, 0

    def add(kind, module, snake, history, stride, pad) -> None:
        nonlocal rate, lag
        channels = module.in_channels if kind != "res" else module.conv1.in_channels
        stages.append(Stage(kind, module, snake, channels, history, rate, rate * stride, lag * stride + pad))
        rate, lag = rate * stride, lag * stride + pad

    def conv(m: nn.Conv1d, snake: Snake1d | None) -> None:
        p = _same_pad(m)
        add("conv", m, snake, 2 * p, 1, p)

    conv(decoder.conv1, None)
    for block in decoder.block:
        t = block.conv_t1
        k, s, p, op = t.kernel_size[0], t.stride[0], t.padding[0], t.output_padding[0]
        if k != 2 * s or k - s - 2 * p + op != 0 or t.dilation[0] != 1 or t.groups != 1:
            raise ConfigError(f"streaming decode needs ConvTranspose1d(k=2s) with output length T*s, got {t}")
        add("conv_t", t, block.snake1, 1, s, p)
        for ru in (block.res_unit1, block.res_unit2, block.res_unit3):
            assert isinstance(ru, ResidualUnit), f"expected a ResidualUnit, got {type(ru).__name__}"
            c2 = ru.conv2
            if c2.kernel_size[0] != 1 or c2.padding[0] != 0:
                raise ConfigError(f"streaming decode needs a pointwise second residual conv, got {c2}")
            p = _same_pad(ru.conv1)
            add("res", ru, None, 2 * p, 1, p)
    conv(decoder.conv2, decoder.snake1)
    return stages


def lookahead_samples(decoder: AcousticDecoder) -> int:
    """Output samples the incremental decoder lags the pushed frames: with P frames pushed, samples
    t < P*hop - lookahead are final. Each layer adds its right padding, scaled by the upsampling after
    it; Higgs v2: 3*960 + (4+39)*120 + (3+39)*24 + (2+39)*6 + (1+39)*3 + (2+39) + 3 = 9458."""
    return plan(decoder)[-1].lag


def _advance(stage: Stage, buf: torch.Tensor, n: int, gemm: bool = False) -> torch.Tensor:
    """buf [B, Cin, history + n] (raw inputs) -> the layer's outputs for the n new inputs [B, Cout, n * stride]; with
    `gemm` its conv (a residual unit's dilated one; the pointwise one stays a conv) as im2col + one GEMM."""
    m = stage.module
    if stage.kind == "conv":
        x = stage.snake(buf) if stage.snake is not None else buf
        return conv1d_gemm(x, m.weight, m.bias, m.dilation[0]) if gemm else \
            F.conv1d(x, m.weight, m.bias, dilation=m.dilation)
    if stage.kind == "conv_t":
        s = m.stride[0]
        x = stage.snake(buf) if stage.snake is not None else buf
        y = conv_transpose1d_gemm(x, m.weight, m.bias, s) if gemm else F.conv_transpose1d(x, m.weight, m.bias, stride=s)
        return y[:, :, s:s + n * s]
    c = m.conv1
    x = m.snake1(buf)
    h = conv1d_gemm(x, c.weight, c.bias, c.dilation[0]) if gemm else F.conv1d(x, c.weight, c.bias, dilation=c.dilation)
    g = F.conv1d(m.snake2(h), m.conv2.weight, m.conv2.bias)  # [B, C, n]
    half = stage.history // 2
    return buf[:, :, half:half + n] + g  # the skip: inputs aligned with g's outputs


# Output samples a frame up to which a stage's convolutions run as GEMMs (`gemm_stage`). Served: 40 (1 kHz), the first
# conv and the first two blocks (session 30, H200, 128 streams x 25 frames: eager step 75.8 vs 87.8 ms all cuDNN,
# graphed 43.7k vs 37.5k frames/s, 23.5k vs 8.0k at 1-frame steps; the first conv alone, session 29's 1: 38.8k).
# Their im2col (~0.64 GB in a 64-stream x 35-frame step at 1 kHz) is captured with the graphs at warm-up, inside the
# served memory bound (34.5 GB held after it vs 36.2 GB with 1). `serve --codec-gemm-max-rate-out 1`: the first conv
# alone.
GEMM_MAX_RATE_OUT = 40


def gemm_stage(stage: Stage, max_rate_out: int = GEMM_MAX_RATE_OUT) -> bool:
    """Whether the stage's convolutions run as im2col + one GEMM each (engine/codec/gemm_conv.py; `_advance`'s `gemm`)
    instead of on cuDNN: the first conv (no Snake; 256 -> 1024 channels, k7), and stages whose output rate is at most
    `max_rate_out` samples a frame. Timed per stage on an H200, 128 streams x 25 frames, cuDNN vs GEMM (session 29,
    scripts/time_codec_gemm.py): the first conv 3.66 vs 0.46 ms (max |d| / peak 1.8e-6); up to 1 kHz (the transposed
    convs from 1024 and 512 channels, the residual units of 512 and 256, sums over 512-3584 products an output)
    1.03-1.62x faster; from 4 kHz on (256 channels and fewer, many positions) 0.61-0.80x. Both in fp32 (the GEMMs
    follow `torch.backends.cuda.matmul.allow_tf32`, off)."""
    return (stage.kind == "conv" and stage.snake is None) or \
        (stage.kind in ("conv_t", "res") and stage.rate_out <= max_rate_out)


# ---------------------------------------------------------------------------- per-stream bookkeeping
@dataclass
class _Stream:
    frames: int = 0  # real frames pushed
    advanced: int = 0  # frames through the stack (real + flush padding)
    total: int | None = None  # frames of the utterance, known at its final push
    emitted: int = 0  # output samples handed out


def _run_width(s: _Stream, valid: int, final: bool, pad: int) -> int:
    """Frames a push runs through the stack: its valid frames, plus `pad` flush frames after a final
    push of a stream that has any frames."""
    return int(valid) + (pad if final and s.frames + valid > 0 else 0)


class StepAudio(NamedTuple):
    audio: torch.Tensor  # [B', C * hop] float32 on the device (B' >= B; may be a graph's output buffer)
    offsets: list[int]  # row b's new samples: audio[b, offsets[b] : offsets[b] + counts[b]]
    counts: list[int]


# ---------------------------------------------------------------------------- the decoder
class StreamingDecoder(SlotArenaDecoder):
    STEP_FIELDS = 4  # slot, frames run (valid + flush), start, end (the arena's staging)
    GRAPH_NAME = "codec streaming"

    def __init__(self, codec: Codec, max_slots: int, gemm: bool | None = None,
                 gemm_max_rate_out: int | None = None) -> None:
        self.stages = plan(codec.acoustic_decoder)
        assert self.stages[-1].rate_out == codec.geometry.hop, \
            f"decoder upsamples by {self.stages[-1].rate_out}, hop is {codec.geometry.hop}"
        # the arena: one [slot, C, H] history tensor per layer
        super().__init__(codec, max_slots, [(st.channels, st.history) for st in self.stages], _Stream)
        # `gemm_stage`s as GEMMs: by default on CUDA (where they are faster), given True on any device (the tests);
        # gemm_max_rate_out None: GEMM_MAX_RATE_OUT
        gemm = self.device.type == "cuda" if gemm is None else gemm
        rate = GEMM_MAX_RATE_OUT if gemm_max_rate_out is None else gemm_max_rate_out
        self._gemm = [gemm and gemm_stage(st, rate) for st in self.stages]

    @property
    def gemm_stages(self) -> int:
        """How many of the decoder's stages run as GEMMs (`gemm_stage`)."""
        return sum(self._gemm)

    def _advance_stage(self, i: int, buf: torch.Tensor, n: int) -> torch.Tensor:
        """Stage i's outputs for the n new inputs of `buf` (`_advance`), a `gemm_stage` as GEMMs except under
        `check_against_native` (PyTorch's native convolutions: the reference the served card's steps are checked
        against)."""
        return _advance(self.stages[i], buf, n, gemm=self._gemm[i] and not self._native_reference)

    def step(self, slots: Sequence[int], codes: torch.Tensor | np.ndarray, valid: Sequence[int],
             final: Sequence[bool]) -> StepAudio:
        """`push` as one device tensor plus per-row (offset, count) (see the module docstring)."""
        codes, streams = self._check(slots, codes, valid, final)
        hop, lookahead, pad = self.geometry.hop, self.geometry.lookahead_samples, self.geometry.lookahead_frames
        n = len(streams)
        # frames each row runs through the stack: its valid frames, plus the flush after a final push
        adv = [_run_width(s, v, f, pad) for s, v, f in zip(streams, valid, final)]
        width = max(adv, default=0)
        starts = [s.advanced for s in streams]
        ends = [s.frames + int(v) if f else OPEN_END for s, v, f in zip(streams, valid, final)]
        if width == 0:
            audio = torch.zeros((n, 0), dtype=torch.float32, device=self.device)
        else:
            audio = self._run(list(slots), codes, width, adv, starts, ends)
        offsets, counts = [], []
        for s, v, f, a in zip(streams, valid, final, adv):
            base = s.advanced * hop - lookahead  # position of this step's first output sample
            s.frames += int(v)
            s.advanced += a
            stop = s.advanced * hop - lookahead
            if f:
                s.total = s.frames
                stop = min(stop, s.total * hop)
            offsets.append(s.emitted - base)
            counts.append(max(0, stop - s.emitted))
            s.emitted = max(s.emitted, stop)
        return StepAudio(audio, offsets, counts)

    @staticmethod
    def _ended(stream: _Stream) -> bool:
        return stream.total is not None

    def widths(self, slots: Sequence[int], valid: Sequence[int], final: Sequence[bool]) -> list[int]:
        """Frames each row would run through the stack (valid, plus the flush after a final push)."""
        pad = self.geometry.lookahead_frames
        out = []
        for slot, v, f in zip(slots, valid, final):
            s = self._streams.get(slot)
            if s is None:
                raise InvalidInputError(f"codec stream slot {slot!r} is not open")
            out.append(_run_width(s, v, f, pad))
        return out

    def partition(self, slots: Sequence[int], valid: Sequence[int], final: Sequence[bool]) -> list[list[int]]:
        """Row indices grouped into the steps that cost least in total (see the module docstring)."""
        widths = self.widths(slots, valid, final)
        order = sorted(range(len(widths)), key=widths.__getitem__)
        frame_buckets = sorted({c for _, c in self._buckets})
        runs: list[tuple[int, int]] = []  # (end position in `order`, widest width) per frame bucket
        last_class = None
        for pos, i in enumerate(order):
            cls = next((c for c in frame_buckets if c >= widths[i]), widths[i])
            if runs and cls == last_class:
                runs[-1] = (pos + 1, widths[i])
            else:
                runs.append((pos + 1, widths[i]))
            last_class = cls
        best, cut = [0.0] + [float("inf")] * len(runs), [0] * (len(runs) + 1)
        for j in range(1, len(runs) + 1):  # best[j]: the cheapest steps for the first j runs
            for i in range(j):
                cost = best[i] + self.step_cost(runs[j - 1][0] - (runs[i - 1][0] if i else 0), runs[j - 1][1])
                if cost < best[j]:
                    best[j], cut[j] = cost, i
        groups, j = [], len(runs)
        while j > 0:
            i = cut[j]
            groups.append(order[(runs[i - 1][0] if i else 0) : runs[j - 1][0]])
            j = i
        return groups[::-1]

    def _math(self, inp: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """One batched step from the staged inputs; updates the arena; returns audio [B, C * hop]."""
        c = shape[1]
        codes, (slots, valid, start, end) = split_inputs(inp, shape, self.geometry.num_codebooks)
        cols = torch.arange(c, device=inp.device)
        real = start[:, None] + cols < end[:, None]  # [B, C] frames of the utterance (not flush padding)
        use = (cols < valid[:, None]) & real
        codes = torch.where(use[:, None, :], codes, 0)  # junk columns -> a valid code
        quantized = self.codec.quantizer.decode(codes)  # [B, H, C]
        x = self.codec.fc2(quantized.transpose(1, 2)).transpose(1, 2)  # [B, D, C]
        fresh = (start == 0)[:, None, None]
        zero = x.new_zeros(())  # torch.where(..., out=) takes no Python scalar
        # each layer's input buffer [B, Cin, H + n]: its history, then the previous layer's masked outputs,
        # written in place (one pass over the activations per layer instead of a mask and a concatenation)
        buf = self._buffer(0, x)
        torch.where(real[:, None, :], x, zero, out=buf[:, :, self.stages[0].history:])
        for i, (stage, state) in enumerate(zip(self.stages, self.states)):
            h = stage.history
            torch.where(fresh, zero, state.index_select(0, slots), out=buf[:, :, :h])
            y = self._advance_stage(i, buf, buf.shape[2] - h)  # [B, Cout, n * stride]
            keep = valid[:, None] * stage.rate_in + torch.arange(h, device=inp.device)  # [B, H]
            state.index_copy_(0, slots, buf.gather(2, keep[:, None, :].expand(-1, stage.channels, -1)))
            pos = start[:, None] * stage.rate_out - stage.lag + torch.arange(y.shape[2], device=inp.device)
            inside = (pos >= 0) & (pos < end[:, None] * stage.rate_out)  # [B, n * stride]
            if i + 1 == len(self.stages):
                x = torch.where(inside[:, None, :], y, 0.0)  # one-shot zero-pads every layer's input
            else:
                buf = self._buffer(i + 1, y)
                torch.where(inside[:, None, :], y, zero, out=buf[:, :, self.stages[i + 1].history:])
        return x[:, 0, :]  # [B, C * hop]

    def _buffer(self, i: int, inputs: torch.Tensor) -> torch.Tensor:
        """Stage i's input buffer for `inputs` [B, Cin, n]: [B, Cin, history + n], uninitialised."""
        b, cin, n = inputs.shape
        return torch.empty((b, cin, self.stages[i].history + n), dtype=inputs.dtype, device=inputs.device)

    # ---- CUDA graphs ----
    def _check_graph(self, key: tuple[int, int], graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> float:
        """One replay vs the eager step from the same arena and inputs (random, some rows mid-stream)."""
        b, c = key
        gen = torch.Generator().manual_seed(b * 1000 + c)
        slots = list(range(b))
        codes = torch.randint(0, self.geometry.codebook_size, (b, self.geometry.num_codebooks, c), generator=gen)
        adv = torch.randint(0, c + 1, (b,), generator=gen).tolist()
        starts = (torch.randint(0, 3, (b,), generator=gen) * torch.randint(1, 40, (b,), generator=gen)).tolist()
        ends = [s + int(torch.randint(0, a + 1, (), generator=gen)) if i % 2 else OPEN_END
                for i, (s, a) in enumerate(zip(starts, adv))]
        adv[0], starts[0] = c, 40  # row 0 mid-stream, all frames valid: real output in every bucket
        start_states = [torch.randn(s.shape, generator=gen).mul_(0.1).to(self.device) for s in self.states]
        return replay_diff(self.states, start_states, b,
                           lambda: self._stage(self._inputs[key], key, slots, codes, adv, starts, ends),
                           lambda: self._eager(key), lambda: (graph.replay(), output)[1])
