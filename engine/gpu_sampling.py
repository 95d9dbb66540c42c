"""Per-stream generation state on the device and one batched sample-and-advance per decode step.

`DeviceStreamState` holds, per slot (one slot per decoding stream), everything a family's host
rule machine keeps in Python (Higgs v2: `models/higgs_v2/policy.SegmentState`): the last row (the
next step's input), the column count, the ramp counters, the RAS window, and the stream's sampling
parameters and seed. A decode step then needs no host round trip: `sample_and_advance(logits,
slots, valid)` samples every row, applies the family's row rules (`rules`, a
`family.DeviceRules` from `models/<family>/device_rules.py`, each kept equal to its host machine by
tests), writes the state back and returns one packed [B, K + 1] tensor (the new rows and a status
per row) for a single asynchronous copy to the host.

A family whose head samples fewer codebooks than a row holds (Qwen3-TTS: group 0 of 16) passes
the head's logits [B, h, V] and the talker's hidden state; the state samples the head, then
completes each row with the family's `complete` (its code predictor), drawing every further
codebook on the device too, so that whole frame step stays one graph. The rules' optional hooks
(`RowRules`: own per-slot tensors, logits processors such as a repetition penalty) run inside it.

Sampling follows engine/sampling.py (same warpers, same exponential race, greedy = argmax of the
raw logits), but the noise is counter-based (kernels/sampling_noise.py): row b's draws depend only
on (seed, column index), so a stream's codes do not depend on what shares its batch. Sampled codes
therefore differ from the CPU engine's generator stream; greedy codes are the same function of the
logits. Slots >= `num_slots` are scratch rows for padded batch entries. Columns are counted from
the AUDIO_INIT column (column 0): a stream's first sampled row is column 1.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from higgs_stream.engine.family import DeviceRules, Pick
from higgs_stream.engine.request import SamplingParams
from higgs_stream.engine.sampling import SamplingTensors
from higgs_stream.kernels import sample_rows, sampling_noise

log = logging.getLogger(__name__)
RECOMPILE_LIMIT = 256  # compiled entries of the fused rules per process (RowRules.fuse)
START_ROWS = 8  # stream starts per staged apply (`DeviceStreamState.start`)
START_INTS = ("win_pos", "win_fill", "ras_window", "ras_max_repeat", "seed", "cap_column", "top_k")
START_FIELDS = 2 + len(START_INTS)  # staged ints per start: slot, START_INTS, greedy; then the start row [K]
# and the RAS window [W * K]

# status column of the packed output
RUNNING, STOP, LENGTH, ERROR, IGNORED = 0, 1, 2, 3, 4
STATUS_REASON = {STOP: "stop", LENGTH: "length"}


@dataclass(frozen=True)
class StreamStart:
    """What the device state needs when a stream reaches AUDIO_INIT."""

    slot: int
    params: SamplingParams  # seed resolved
    max_frames: int
    context_audio: np.ndarray  # [K, A] int64, the prompt's audio-out columns (RAS window seed)


class DeviceStreamState:
    def __init__(self, num_slots: int, scratch_slots: int, num_codebooks: int, codebook_size: int,
                 device: torch.device, rules: DeviceRules, ras_window_max: int = 16,
                 fast_kernels: bool | None = None, vocab: int | None = None,
                 complete: Callable[[torch.Tensor, torch.Tensor, Pick], torch.Tensor] | None = None,
                 fuse_rules: bool = False) -> None:
        """`vocab`: ids the head samples per codebook (default codebook_size + 2: codes, BOS, EOS).
        `complete`: a family whose head samples fewer codebooks than K completes each row with it
        (family.RowCompleter.complete_rows: the talker's hidden state, the head's ids and a pick).
        `fuse_rules`: compile the rules' integer part if the family has one (`RowRules.fuse`; ignored if not)."""
        s, k = num_slots + scratch_slots, num_codebooks
        self.rules = rules
        self.num_slots, self.k, self.v = num_slots, k, vocab or codebook_size + 2
        self.complete = complete
        self.bos, self.eos = codebook_size, codebook_size + 1
        self.w = ras_window_max
        self.device = torch.device(device)
        self.fast_kernels = self.device.type == "cuda" if fast_kernels is None else fast_kernels
        self._exp_noise = sampling_noise.exp_noise if self.fast_kernels else sampling_noise.exp_noise_ref
        self._sample_rows = sample_rows.sample_rows if self.fast_kernels else sample_rows.sample_rows_ref

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        self.last_col = zeros(s, k)  # the column fed back next step
        self.ncols = zeros(s)  # columns emitted so far (the BOS column included)
        self.num_delay = zeros(s)
        self.num_remaining = zeros(s) - 1  # -1: no ramp-out yet
        self.stop_reason = zeros(s) + STOP  # STOP, or LENGTH when the frame cap started the ramp-out
        self.done = torch.ones(s, dtype=torch.bool, device=self.device)  # free or finished
        self.cap_column = zeros(s)
        self.window = zeros(s, self.w, k)  # ring buffer of the last columns
        self.win_pos = zeros(s)
        self.win_fill = zeros(s)
        self.ras_window = zeros(s)
        self.ras_max_repeat = zeros(s) + 1
        self.seed = zeros(s)
        self.temperature = torch.ones(s, device=self.device)
        self.top_k = zeros(s) + self.v
        self.top_p_cut = zeros(s, dtype=torch.float32) - 1.0
        self.greedy = zeros(s, dtype=torch.bool)
        self._codebook = torch.arange(k, device=self.device)[None]  # [1, K]
        self._age = torch.arange(self.w, device=self.device)[None]  # [1, W]
        self._start_ints = zeros(START_ROWS, START_FIELDS + (self.w + 1) * k)  # `start`'s staged rows
        self._start_floats = zeros(START_ROWS, 2, dtype=torch.float32)
        self._start_graph: torch.cuda.CUDAGraph | None = None
        rules.attach(self)
        if fuse_rules and getattr(rules, "fusible", False):
            rules.fuse(self)

    # ------------------------------------------------------------------ host -> device (AUDIO_INIT)
    def start(self, starts: Sequence[StreamStart]) -> None:
        """Reset the slots of streams that reach AUDIO_INIT: their start row (the family's; Higgs:
        the all-BOS column) is emitted now. Host side: every field of up to START_ROWS streams in
        two copies into static buffers, then one apply (`_apply_start`, replayed from a CUDA graph
        once `capture_start` ran: padded with scratch slots): 3 launches from Python instead of
        ~25, each of which waited for the GIL behind the server's other threads under load."""
        if not starts:
            return
        if not self.rules.uses_ras:  # no window, whatever the request says
            starts = [replace(st, params=replace(st.params, ras_window=0)) for st in starts]
        for st in starts:
            assert 0 <= st.slot < self.num_slots, f"slot {st.slot} outside [0, {self.num_slots})"
            if st.params.ras_window > self.w:
                raise ValueError(f"ras_window {st.params.ras_window} exceeds the device window {self.w}")
        n, k, w, f = len(starts), self.k, self.w, START_FIELDS + self.k
        start_row = np.array(self.rules.start_row(k, self.bos), np.int64)  # [K], the family's (Higgs: all BOS)
        ints = np.zeros((n, f + w * k), np.int64)
        ints[:, START_FIELDS:f] = start_row
        floats = np.zeros((n, 2), np.float32)
        for i, st in enumerate(starts):  # context audio (last ras_window columns), then the start row
            p, r = st.params, st.params.ras_window
            ctx = st.context_audio[:, max(0, st.context_audio.shape[1] - r):].T if r > 0 else np.zeros((0, k), np.int64)
            cols = np.concatenate([ctx, start_row[None]])[-w:]
            ints[i, f:f + cols.size] = cols.reshape(-1)
            ints[i, :START_FIELDS] = (st.slot, len(cols) % w, len(cols), r, p.ras_max_repeat, p.seed,
                                      self.rules.cap(st.max_frames), min(p.top_k, self.v) if p.top_k else self.v,
                                      p.greedy)
            floats[i] = (p.temperature if not p.greedy else 1.0, 1.0 - p.top_p if p.top_p < 1.0 else -1.0)
        for i in range(0, n, START_ROWS):
            m = min(START_ROWS, n - i)
            b = START_ROWS if self._start_graph is not None else m
            chunk_i, chunk_f = self._scratch_starts(b)
            chunk_i[:m], chunk_f[:m] = ints[i:i + m], floats[i:i + m]
            self._stage_starts(chunk_i, chunk_f)
            if self._start_graph is not None:
                self._start_graph.replay()
            else:
                self._apply_start(b)

    def _scratch_starts(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """b staged rows that reset scratch slots to a fresh state's values (padded graph rows read
        their sampling parameters: a top-k of 0 would index out of range)."""
        ints = np.zeros((b, self._start_ints.shape[1]), np.int64)
        ints[:, 0] = self.num_slots + np.arange(b)
        ints[:, 1 + START_INTS.index("ras_max_repeat")] = 1
        ints[:, 1 + START_INTS.index("top_k")] = self.v
        floats = np.zeros((b, 2), np.float32)
        floats[:, 0], floats[:, 1] = 1.0, -1.0  # temperature, no top-p cut
        return ints, floats

    def _stage_starts(self, ints: np.ndarray, floats: np.ndarray) -> None:
        """Staged rows into the static buffers `_apply_start` reads: two copies."""
        self._start_ints[:len(ints)].copy_(torch.from_numpy(ints), non_blocking=True)
        self._start_floats[:len(floats)].copy_(torch.from_numpy(floats), non_blocking=True)

    def _apply_start(self, b: int) -> None:
        """The device half of `start` for the first b staged rows (graph-capturable: no host sync)."""
        ints, floats, f = self._start_ints[:b], self._start_floats[:b], START_FIELDS + self.k
        slots = ints[:, 0]
        self.window[slots] = ints[:, f:].unflatten(1, (self.w, self.k))
        for j, name in enumerate(START_INTS):
            getattr(self, name)[slots] = ints[:, 1 + j]
        self.greedy[slots] = ints[:, START_FIELDS - 1] != 0
        self.temperature[slots] = floats[:, 0]
        self.top_p_cut[slots] = floats[:, 1]
        self.last_col[slots] = ints[:, START_FIELDS:f]
        for name, value in (("ncols", 1), ("num_delay", 0), ("num_remaining", -1), ("stop_reason", STOP)):
            getattr(self, name).index_fill_(0, slots, value)  # a scalar fill: no host tensor (graph capture)
        self.done.index_copy_(0, slots, slots >= self.num_slots)  # scratch slots (padding) stay done
        self.rules.start(self, slots)

    def capture_start(self) -> None:
        """CUDA: replay `_apply_start` from a graph (START_ROWS rows, padded with scratch slots)."""
        from higgs_stream.engine.graph_capture import capture_buckets

        assert self.last_col.shape[0] >= self.num_slots + START_ROWS, "the graph pads starts with scratch slots"

        graphs, _ = capture_buckets((START_ROWS,), lambda b: self._stage_starts(*self._scratch_starts(b)),
                                    self._apply_start, self.device)
        self._start_graph = graphs[START_ROWS]

    def release(self, slot: int) -> None:
        # a fill of a one-row slice: `done[slot] = True` copies a host scalar into a 0-dim view, a pageable
        # host-to-device copy that waits for the stream (every step in flight: 5 ms per finished stream on
        # average, up to a whole step, in an H100 trace of Qwen3-TTS at 20 req/s; scripts/top_samples.py)
        self.done[slot:slot + 1].fill_(True)

    # ------------------------------------------------------------------ the decode-step tail
    def noise(self, slots: torch.Tensor, h: int | None = None) -> torch.Tensor:
        """[B, 2, h, V] Exp(1) noise of these slots' current column (sampling | RAS candidate) for
        the head's h codebooks (default K)."""
        h = h or self.k
        return self._exp_noise(self.seed[slots], self.ncols[slots], 2 * h * self.v).view(-1, 2, h, self.v)

    def _sampling(self, slots: torch.Tensor, vocab: int | None = None) -> SamplingTensors:
        top_k = self.top_k[slots] if vocab is None else torch.clamp(self.top_k[slots], max=vocab)
        return SamplingTensors(temperature=self.temperature[slots], top_k=top_k, top_p_cut=self.top_p_cut[slots],
                               greedy=self.greedy[slots], use_top_k=True, use_top_p=True)

    def sample_and_advance(self, logits: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor,
                           hidden: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, h, V] fp32 (h = K, or the head's codebooks of a family that completes rows),
        slots [B] long, valid [B] bool, hidden [B, H] (the talker's final-normed state at each row;
        only a family that completes rows reads it) -> packed [B, K + 1] long (the emitted row, then
        RUNNING/STOP/LENGTH/ERROR, or IGNORED for invalid/finished rows).

        The family's logits processors (`rules.process`) run on the head's logits first; rows are
        completed by `complete` (each further codebook drawn by `pick`) before the family's row rules.
        Graph-capturable: fixed shapes, no host synchronisation.
        """
        live = valid & ~self.done[slots]  # [B]
        finite = torch.isfinite(logits).all(dim=2).all(dim=1)  # [B], on the raw logits
        clean = torch.where(finite[:, None, None], logits, torch.zeros_like(logits))
        clean = self.rules.process(self, clean, slots)  # identity for the Higgs families
        st = self._sampling(slots)
        noise = self.noise(slots, logits.shape[1])  # [B, 2, h, V]
        tokens, _ = self._draw(clean, noise[:, 0], st, clean=False)  # [B, h]
        if tokens.shape[1] < self.k:
            assert self.complete is not None and hidden is not None, "completing rows needs `complete` and hidden"
            tokens, ok = self._complete(hidden, tokens, slots)  # [B, K]
            finite = finite & ok
        return self.rules.advance(self, tokens, clean, noise, slots, live, finite)  # the family's row rules

    def _draw(self, logits: torch.Tensor, noise: torch.Tensor, st: SamplingTensors, clean: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draw per row of logits [B, h, V] (kernels/sample_rows.py: fused on the fast path)."""
        return self._sample_rows(logits, noise, st.temperature, st.top_k, st.top_p_cut, st.greedy, clean=clean)

    def _complete(self, hidden: torch.Tensor, head: torch.Tensor, slots: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole rows [B, K] from `complete`, and whether every logit it sampled from was finite [B].

        Codebook c >= h is drawn like the head's (the stream's temperature, top-k clamped to the
        codebook's vocabulary, top-p; greedy: the argmax), with noise keyed on (seed ^ c << 40,
        column): independent of the head's draws and of the batch."""
        ok = torch.ones(head.shape[0], dtype=torch.bool, device=head.device)
        seeds, ncols, st = self.seed[slots], self.ncols[slots], None  # gathered once for every codebook

        def pick(codebook: int, logits: torch.Tensor) -> torch.Tensor:  # [B, Vc] fp32 -> [B]
            nonlocal ok, st
            if st is None:
                st = self._sampling(slots, logits.shape[-1])
            noise = self._exp_noise(seeds ^ (codebook << 40), ncols, logits.shape[-1])  # [B, Vc]
            tokens, finite = self._draw(logits[:, None], noise[:, None], st, clean=True)
            ok = ok & finite[:, 0]
            return tokens[:, 0]

        return self.complete(hidden, head, pick), ok


def commit_rows(state: DeviceStreamState, slots: torch.Tensor, tokens: torch.Tensor, ncols: torch.Tensor,
                finished: torch.Tensor, reason: torch.Tensor, live: torch.Tensor,
                finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The end every family's `advance` shares: each row's status (`reason` where `finished`, else
    RUNNING; ERROR for non-finite logits; IGNORED for a row not live) and, for the rows that advance
    (live and finite), their new last row `tokens` [B, K], column count (`ncols` + 1) and done flag.
    Returns (status [B], keep [B]: the rows that keep their state, for the family's own tensors)."""
    status = torch.where(finished, reason, RUNNING)
    status = torch.where(finite, status, ERROR)
    status = torch.where(live, status, IGNORED)
    keep = ~(live & finite)
    state.last_col.index_copy_(0, slots, torch.where(keep[:, None], state.last_col[slots], tokens))
    state.ncols.index_copy_(0, slots, torch.where(keep, ncols, ncols + 1))
    state.done.index_copy_(0, slots, state.done[slots] | (live & (finished | ~finite)))
    return status, keep


class RowRules:
    """The optional hooks of `family.DeviceRules`, as the Higgs families use them (no per-slot state
    of their own, no logits processors); a family's rules subclass it and override what they need.

    A family whose `advance` ends in a `rows(state, tokens, candidate, slots, live, finite)` method of integer and
    boolean tensor ops only sets `fusible = True`: `fuse` then compiles it (torch.compile, Inductor), which runs
    its ~100 small kernels as a few fused ones and computes the same integers on any device (no float op in it)."""

    fusible = False

    def fuse(self, state: DeviceStreamState) -> None:
        """Compile `rows` (dynamic batch size) and run it at 1 and 2 rows on rows that are not live (their state is
        written back unchanged), under no_grad and under inference_mode (dynamo guards on the mode: the decode graphs
        are captured under the one, eager steps run under the other; a call with grad enabled runs as no_grad), so
        every compile happens here and none at a step's first use."""
        assert self.fusible, f"{type(self).__name__} has no integer-only `rows` to fuse"
        # every state of a process shares the function's compiled entries, each guarded on its state's tensor sizes:
        # a process with many engines (the GPU tests) passes dynamo's default of 8 entries a function, where a
        # fullgraph compile fails instead of falling back; a server has one state (4 entries)
        import torch._dynamo  # noqa: F401 (its config)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        compiled = torch.compile(self.rows, fullgraph=True, dynamic=True)  # type: ignore[attr-defined]

        @functools.wraps(compiled)
        def rows(*args: Any) -> torch.Tensor:
            if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
                return compiled(*args)
            with torch.no_grad():
                return compiled(*args)

        self.rows = rows
        t0 = time.perf_counter()
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                for b in (1, 2):
                    slots = torch.arange(b, device=state.device) % state.last_col.shape[0]
                    live, finite = (torch.zeros(b, dtype=torch.bool, device=state.device) for _ in range(2))  # not
                    clean = torch.zeros(b, state.k, state.v, device=state.device)  # aliased: dynamo guards on it too
                    noise = torch.ones(b, 2, state.k, state.v, device=state.device)
                    self.advance(state, state.last_col[slots].clone(), clean, noise, slots, live, finite)  # type: ignore[attr-defined]
        log.info("fused %s's row rules (torch.compile) in %.1f s", type(self).__name__, time.perf_counter() - t0)

    def attach(self, state: DeviceStreamState) -> None:
        """Allocate the rules' own per-slot tensors (called once, by the state's constructor)."""

    def start(self, state: DeviceStreamState, slots: torch.Tensor) -> None:
        """Reset the rules' own state of streams that start on `slots` [n] long."""

    def process(self, state: DeviceStreamState, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The family's logits processors: the head's logits [B, h, V] fp32 -> the same, processed."""
        return logits
