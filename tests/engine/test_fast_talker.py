"""FastTalker (fused weights, fp32 residual stream, plain-torch kernels) == the talker it re-packs.

v3: a mixed ragged step (prompt text rows, reference audio rows, two sequences) gives the same
audio logits and K/V as `TalkerV3.forward`, QK-norm included. Both families: RoPE tables cover
the engine's context cap even where config.json's max_position_embeddings is smaller.
"""

from __future__ import annotations

import pytest
import torch

from higgs_stream.engine.batch import StepBatch
from higgs_stream.engine.fast_talker import FastInputs, FastTalker
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.models.higgs_v2.config import TalkerConfig
from higgs_stream.engine.models.higgs_v2.talker import Talker
from higgs_stream.engine.models.higgs_v3.config import TalkerV3Config
from higgs_stream.engine.models.higgs_v3.talker import TalkerV3
from higgs_stream.kernels.flashinfer_attention import RefAttention


def random_talker(arch: str, max_positions: int = 64, **cfg_overrides) -> Talker | TalkerV3:
    """Random fp32 weights scaled so attention is far from uniform and norms are not all ones."""
    torch.manual_seed(0)
    if arch == "v3":
        talker = TalkerV3(TalkerV3Config.tiny(**cfg_overrides), max_positions=max_positions)
    else:
        talker = Talker(TalkerConfig.tiny(**cfg_overrides), max_positions=max_positions)
    with torch.no_grad():
        for p in talker.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.5 * p.shape[1] ** -0.5)
    return talker.eval()


def run_both(talker, positions: torch.Tensor, qo_lens: list[int], is_audio: torch.Tensor, seed: int = 0):
    """(talker.forward audio logits, its K pool, FastTalker logits, its K pool) on one ragged step."""
    cfg = talker.cfg
    gen = torch.Generator().manual_seed(seed)
    n = len(positions)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
    codes = torch.randint(0, cfg.audio_vocab, (n, cfg.num_codebooks), generator=gen)
    caches = [KVCache.create(cfg, num_pages=16, page_size=4) for _ in range(2)]
    for cache in caches:
        for sid, q in enumerate(qo_lens):
            cache.allocator.reserve(sid, q)
    sids = list(range(len(qo_lens)))
    batch = StepBatch(seq_ids=sids, qo_lens=qo_lens, input_ids=ids, audio_codes=codes, is_audio=is_audio,
                      positions=positions, want_text=torch.zeros(len(sids), dtype=torch.bool),
                      want_audio=torch.ones(len(sids), dtype=torch.bool))
    want = talker.forward(batch, caches[0]).audio_logits  # [B, K, V]
    fast = FastTalker(talker, "ref", max_positions=talker.max_positions)
    layout = caches[1].layout(sids, qo_lens)
    attn = RefAttention(cfg.head_dim)
    attn.plan_layout(layout)
    all_audio = bool(is_audio.all())
    inp = FastInputs(text_ids=None if all_audio else ids, codes=codes, positions=positions,
                     kv_slots=layout.slot_mapping, out_rows=layout.last_token_index,
                     audio_rows=None if all_audio else is_audio.nonzero().flatten(),
                     text_rows=None if all_audio else (~is_audio).nonzero().flatten(),
                     select=None if all_audio else is_audio.int())
    with torch.no_grad():
        got = fast.forward(inp, attn, caches[1].pool.k, caches[1].pool.v)
    return want, caches[0].pool.k, got, caches[1].pool.k


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_v3_mixed_step_equals_talker_v3():
    talker = random_talker("v3")
    keys = set(talker.state_dict())
    is_audio = torch.tensor([False] * 3 + [True] * 5 + [False] * 2 + [True] * 4)  # text, ref rows, text | ...
    positions = torch.cat([torch.arange(10), torch.arange(4)])
    want, want_k, got, got_k = run_both(talker, positions, [10, 4], is_audio)
    assert want.std() > 0.5  # logits far from flat: the comparison means something
    assert rel_err(got, want) < 1e-5 and rel_err(got_k, want_k) < 1e-5, (rel_err(got, want), rel_err(got_k, want_k))
    assert set(talker.state_dict()) == keys  # re-packing kept every key
    fast = FastTalker(talker, "ref")
    assert fast.audio_head is fast.embed_audio  # tied: one matrix is the embedding and the head
    assert all(layer.qk_norm.shape == (2, talker.cfg.head_dim) and len(layer.gate_up) == 1 for layer in fast.layers)


def test_v3_decode_step_equals_talker_v3():
    """An all-audio step (the decode path: no text rows, one norm and MLP for every row)."""
    talker = random_talker("v3")
    want, want_k, got, got_k = run_both(talker, torch.tensor([5, 9, 0]), [1, 1, 1], torch.ones(3, dtype=torch.bool))
    assert rel_err(got, want) < 1e-5 and rel_err(got_k, want_k) < 1e-5


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_rope_covers_the_engine_context_cap(arch):
    """config.json says 2048 positions (the v2 transformers-native file does); the engine's cap is 3000."""
    talker = random_talker(arch, max_positions=3000, max_position_embeddings=2048)
    fast = FastTalker(talker, "ref", max_positions=3000)
    assert fast.max_positions == 3000 and fast.cos_sin.shape == (3000, talker.cfg.head_dim)
    positions = torch.tensor([2041, 2500, 2997, 2998, 2999, 7])
    is_audio = torch.tensor([False, True, True, True, True, True])
    want, _, got, _ = run_both(talker, positions, [5, 1], is_audio)
    assert rel_err(got, want) < 1e-5


def test_audio_step_bytes_counts_the_audio_path():
    """v3: every layer weight (one branch) + QK-norms + the fused matrix once + 8 embedding rows."""
    talker = random_talker("v3")
    cfg = talker.cfg
    fast = FastTalker(talker, "ref")
    params = {k: v for k, v in talker.state_dict().items()}
    fused = params.pop("tied.embedding.modality_embeddings.0.embedding.weight")
    params.pop("tied.embedding.text_embedding.weight")  # text rows never run on an audio step
    want = sum(t.numel() for t in params.values()) + fused.numel() + cfg.num_codebooks * cfg.hidden_size
    assert fast.audio_step_bytes() == 4 * want
