"""One categorical draw per row of logits: temperature, top-k, top-p, softmax and the exponential race
(or the greedy argmax) in one kernel launch (Triton, CUDA, fp32).

    scores = logits / temperature
    keep   = scores >= k-th largest score                      (top-k; ties kept)
    keep  &= not in the ascending prefix whose cumulative       (top-p over the top-k distribution;
             softmax mass is <= 1 - top_p                        the largest score always kept)
    token  = argmax(softmax(scores | keep) / noise)            (the exponential race; noise ~ Exp(1))
    token  = argmax(logits) on greedy rows

`warp_scores_ref` is the warpers' plain-torch definition (transformers' TopK/TopP warpers, applied in
that order), `sample_rows_ref` the draw built on it; `sample_rows` is the kernel. The plain form
launches ~30 kernels per draw (two sorts over the vocabulary among them); the Qwen3-TTS code predictor
draws 15 codebooks per frame one after another, so a batch-1 frame step spent ~450 launches on its
draws. The kernel sorts nothing: it maps each score to an int key in the same order (the float's bits,
the negative ones' magnitude bits flipped) and bisects over keys, 33 halvings of the key range each: the
top-k threshold is the largest key with at least k scores at or above it, the top-p threshold the
smallest key whose probability mass at or below it exceeds 1 - top_p (the warper's dropped ascending
prefix lies below it). Each halving is one count or masked sum over the row held in registers. A
bitonic sort of the row in registers before (tl.sort, then a reverse cumulative sum) was 2-6.7x slower
at the served shapes (H100, scripts/bench_sampling.py, top-p 0.95: v2's 8 heads of 1,026 ids at 256
rows 448 vs 67 us, 1 row 39 vs 14; the Qwen3-TTS predictor's 2,048 ids 29 vs 13, its talker's 3,072
68 vs 15), for the same tokens (none differed from the reference outside rounding-ambiguous rows).
A row whose warper is off (top-k = V, top-p cut -1) skips that bisection.

Rounding: the kernel's softmax sums differ from torch's in summation order, so a draw can
differ from `sample_rows_ref` only where a cumulative mass lies within rounding of the top-p cut or
two race ratios lie within rounding of each other; tokens tied in score at the top-p boundary are
all kept (the warper's unstable sort keeps an arbitrary subset of them). The noise is an input, so
each row's draw depends only on its own logits, parameters and noise (no batch-wide generator, as
FlashInfer's fused samplers use: streams must draw the same codes whatever shares their batch).
"""

from __future__ import annotations

import functools

import torch

from higgs_stream.kernels._triton import pdl_args, require_cuda, triton_modules


def warp_scores_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p_cut: torch.Tensor,
                    use_top_k: bool = True, use_top_p: bool = True) -> torch.Tensor:
    """[S, K, V] logits, [S] temperature / top_k (V when off) / top_p_cut (1 - top_p, -1 when off)
    -> [S, K, V] scores after temperature, top-k, top-p (-inf where removed)."""
    s, k, _ = logits.shape
    scores = logits / temperature[:, None, None]
    if use_top_k:  # keep scores >= the k-th largest of the row (ties kept, as TopKLogitsWarper)
        desc = scores.sort(dim=-1, descending=True).values  # [S, K, V]
        kth = desc.gather(-1, (top_k - 1).view(s, 1, 1).expand(s, k, 1))  # [S, K, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if use_top_p:  # drop the ascending-sorted prefix with cumulative prob <= 1 - top_p, keep the top
        asc, order = scores.sort(dim=-1, descending=False)  # (TopPLogitsWarper, min_tokens_to_keep=1)
        cum = asc.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= top_p_cut[:, None, None]
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_rows_ref(logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p_cut: torch.Tensor, greedy: torch.Tensor, clean: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [B, H, V] fp32, noise [B, H, V] Exp(1), per-stream [B] temperature (1 on greedy rows),
    top_k (<= V), top_p_cut, greedy (bool) -> (tokens [B, H] long, finite [B, H] bool).

    `clean`: rows holding a NaN or an infinity are drawn from zeros instead and reported not finite
    (a caller that has cleaned and processed its logits already, -inf suppressions included, passes
    False and gets None for `finite`)."""
    finite = None
    if clean:
        finite = torch.isfinite(logits).all(dim=-1)  # [B, H]
        logits = torch.where(finite[..., None], logits, torch.zeros_like(logits))
    probs = warp_scores_ref(logits, temperature, top_k, top_p_cut).softmax(dim=-1)
    sampled = (probs / noise).argmax(dim=-1)  # [B, H]
    return torch.where(greedy[:, None], logits.argmax(dim=-1), sampled), finite


@functools.cache
def _kernel():
    triton, tl = triton_modules()

    @triton.jit
    def sample_kernel(x_ptr, noise_ptr, temp_ptr, topk_ptr, cut_ptr, greedy_ptr, tok_ptr, finite_ptr,
                      x_sb, x_sh, n_sb, n_sh, heads, vocab, BLOCK: tl.constexpr, CLEAN: tl.constexpr,
                      PDL: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (kernels/_triton.py): first wait for the kernel before
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        inside = offs < vocab
        x = tl.load(x_ptr + b * x_sb + h * x_sh + offs, mask=inside, other=0.0)
        if CLEAN:  # a row holding NaN or +-inf is drawn from zeros and reported
            finite = tl.sum(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=0) == 0
            x = tl.where(finite, x, 0.0)
            tl.store(finite_ptr + b * heads + h, finite.to(tl.int8))
        x = tl.where(inside, x, float("-inf"))
        greedy_tok = tl.argmax(x, axis=0)
        s = x / tl.load(temp_ptr + b)
        top = tl.max(s, axis=0)
        # thresholds by bisection over the scores' order-preserving int32 keys (no sort)
        s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0: equal floats, one key
        bits = s.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)  # float order == int order (no NaN here)
        key = tl.where(inside, key, -(1 << 40))  # padding below every score
        k = tl.load(topk_ptr + b)
        # top-k: the largest key with at least k scores at or above it (the k-th largest score)
        kth_key = tl.min(tl.where(inside, key, 1 << 40), axis=0)  # k = vocab (off): the smallest
        if k < vocab:
            lo = kth_key  # k <= vocab scores at or above it
            hi = tl.max(key, axis=0) + 1  # none at or above it
            for _ in range(33):  # keys span < 2^33
                mid = lo + (hi - lo) // 2
                enough = tl.sum((key >= mid).to(tl.int32), axis=0) >= k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid)
            kth_key = lo
        # top-p over the top-k distribution: the smallest key whose mass at or below it exceeds the cut
        cut = tl.load(cut_ptr + b)
        p_key = kth_key  # top-p off (cut -1): keep the top-k
        if cut >= 0.0:
            e = tl.where(key >= kth_key, tl.exp(s - top), 0.0)
            prob = e / tl.sum(e, axis=0)
            lo = kth_key - 1  # mass 0 at or below it
            hi = tl.max(key, axis=0)  # every kept score's mass (~1 > cut; the largest score always kept)
            for _ in range(33):
                mid = lo + (hi - lo) // 2
                over = tl.sum(tl.where(key <= mid, prob, 0.0), axis=0) > cut
                lo = tl.where(over, lo, mid)
                hi = tl.where(over, mid, hi)
            p_key = hi
        keep = (key >= kth_key) & (key >= p_key)
        w = tl.where(keep, tl.exp(s - top), 0.0)
        ratio = tl.where(inside, (w / tl.sum(w, axis=0)) / tl.load(noise_ptr + b * n_sb + h * n_sh + offs,
                                                                     mask=inside, other=1.0), -1.0)
        tok = tl.where(tl.load(greedy_ptr + b) != 0, greedy_tok, tl.argmax(ratio, axis=0))
        tl.store(tok_ptr + b * heads + h, tok.to(tl.int64))

    return triton, sample_kernel


def sample_rows(logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p_cut: torch.Tensor, greedy: torch.Tensor, clean: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of `sample_rows_ref` (CUDA; rows of `logits` / `noise` contiguous in V, any
    stride over B and H). Graph-capturable: no host synchronisation."""
    require_cuda(logits, noise, temperature, top_k, top_p_cut, greedy, what="sample_rows")
    return _launch(logits, noise, temperature, top_k, top_p_cut, greedy, clean)


def _launch(logits: torch.Tensor, noise: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
            top_p_cut: torch.Tensor, greedy: torch.Tensor, clean: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    b, h, v = logits.shape
    assert noise.shape == logits.shape and logits.stride(2) == 1 and noise.stride(2) == 1, "rows must be contiguous"
    assert logits.dtype == torch.float32 and noise.dtype == torch.float32, "fp32 logits and noise"
    assert top_k.dtype == torch.long and greedy.dtype == torch.bool, "top_k int64, greedy bool"
    # one value a row, read at the row's element offset: an expanded (stride-0) or strided view would be misread
    assert all(t.shape == (b,) and t.is_contiguous() for t in (temperature, top_k, top_p_cut, greedy)), \
        "temperature, top_k, top_p_cut, greedy: contiguous [B]"
    triton, kernel = _kernel()
    tokens = torch.empty((b, h), dtype=torch.long, device=logits.device)
    finite = torch.empty((b, h), dtype=torch.int8, device=logits.device)  # bools, as bytes the kernel writes
    if b and h:
        block = triton.next_power_of_2(v)
        kernel[(b, h)](logits, noise, temperature, top_k, top_p_cut, greedy.view(torch.int8), tokens, finite,
                       logits.stride(0), logits.stride(1), noise.stride(0), noise.stride(1), h, v,
                       BLOCK=block, CLEAN=clean, **pdl_args(), num_warps=4 if block <= 2048 else 8)
    return tokens, finite.view(torch.bool) if clean else None
