"""v3 talker: backbone parity with transformers' Qwen3ForCausalLM, and the fused audio matrix.

The reference gets the same tensors (our checkpoint keys renamed through the peers' prefix map)
and the same input embeddings: text rows through its embed_tokens, audio rows as the sum of the
8 rows `code_k + k*1026` of the fused matrix, summed by hand here. We compare every layer's
hidden state and the tied text-head logits at every prefill position and every decode step, in
fp32, with max relative error <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.models.higgs_v3.checkpoint import AUDIO_MATRIX, talker_key_shapes, to_qwen3_key
from higgs_stream.engine.models.higgs_v3.config import TalkerV3Config
from higgs_stream.engine.models.higgs_v3.talker import TalkerV3

TOL = 1e-5
K, V = 8, 1026


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def qwen3_config(cfg: TalkerV3Config) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, tie_word_embeddings=True,
        attn_implementation="eager",
    )


def make_pair(cfg: TalkerV3Config, seed: int = 0) -> tuple[Qwen3ForCausalLM, TalkerV3]:
    """Random weights (scaled so attention is far from uniform) in ours; the reference loads them renamed."""
    torch.manual_seed(seed)
    ours = TalkerV3(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "embedding" in name:
                p.normal_(0.0, 1.0 if name != AUDIO_MATRIX else 0.5)
            else:
                p.normal_(0.0, 1.5 * p.shape[1] ** -0.5)
    hf = Qwen3ForCausalLM(qwen3_config(cfg)).eval()
    renamed = {to_qwen3_key(k): v for k, v in ours.state_dict().items() if k != AUDIO_MATRIX}
    missing, unexpected = hf.load_state_dict(renamed, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == [], (missing, unexpected)
    hf.tie_weights()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf, ours


def fused_by_hand(matrix: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """codes [N, 8] -> [N, H]: sum over k of matrix[k * 1026 + codes[:, k]]."""
    out = torch.zeros(codes.shape[0], matrix.shape[1], dtype=matrix.dtype)
    for k in range(K):
        out += matrix[k * V + codes[:, k]]
    return out


class Seq:
    """ids [T], codes [T, 8], is_audio [T]: text, delayed reference rows, text, <|audio|>, decode rows."""

    def __init__(self, cfg: TalkerV3Config, gen: torch.Generator, n_text: int, n_ref: int, n_decode: int) -> None:
        s = cfg.special
        text = torch.randint(0, 256, (n_text,), generator=gen)
        ids = [torch.tensor([s.tts, s.ref_audio]), torch.full((n_ref,), s.tts), torch.tensor([s.text]), text,
               torch.tensor([s.audio]), torch.full((n_decode,), s.audio)]
        self.ids = torch.cat(ids)
        self.is_audio = torch.zeros(len(self.ids), dtype=torch.bool)
        self.is_audio[2:2 + n_ref] = True
        self.is_audio[len(self.ids) - n_decode:] = True  # decode steps feed the previous row at <|audio|>
        self.codes = torch.randint(0, 1024, (len(self.ids), K), generator=gen)
        ref_rows = torch.arange(2, 2 + n_ref)
        for k in range(K):  # reference rows follow the delay pattern: BOC ramp in, EOC ramp out
            self.codes[ref_rows[:k], k] = 1024
            self.codes[ref_rows[n_ref - (K - 1 - k):], k] = 1025
        self.codes[~self.is_audio] = 0
        self.prompt_len = len(self.ids) - n_decode

    def __len__(self) -> int:
        return len(self.ids)

    def embeds(self, hf: Qwen3ForCausalLM, matrix: torch.Tensor) -> torch.Tensor:
        """[1, T, H]: the reference's text embeddings, hand-fused audio rows."""
        with torch.no_grad():
            x = hf.model.embed_tokens(self.ids)
            x[self.is_audio] = fused_by_hand(matrix, self.codes[self.is_audio])
        return x[None]


def test_state_dict_keys_are_the_checkpoint_key_table():
    cfg = TalkerV3Config.tiny()
    sd = TalkerV3(cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == talker_key_shapes(cfg)
    assert len(sd) == cfg.num_layers * 11 + 3
    full = talker_key_shapes(TalkerV3Config.full())
    backbone = [k for k in full if k != AUDIO_MATRIX]
    assert len(backbone) == 398  # openinfer's count on the real checkpoint: 36 x 11 + embedding + norm
    assert full[AUDIO_MATRIX] == (8208, 2560)


@pytest.mark.parametrize("heads,layers", [((4, 2), 2), ((4, 1), 3), ((4, 4), 2)])
def test_prefill_and_every_decode_step_match_qwen3(heads, layers, step_batch):
    """Ours: the prompt in chunks 6/9/rest, then one <|audio|> step per decode row; reference: one
    cached prefill over inputs_embeds, then its cached decode path. All hidden states + logits."""
    cfg = TalkerV3Config.tiny(num_heads=heads[0], num_kv_heads=heads[1], num_layers=layers)
    hf, ours = make_pair(cfg, seed=layers)
    seq = Seq(cfg, torch.Generator().manual_seed(1), n_text=7, n_ref=11, n_decode=5)
    matrix = ours.audio.embedding.weight.detach()
    embeds = seq.embeds(hf, matrix)
    p = seq.prompt_len

    ref_hidden, ref_logits = [], []  # per call: list of [T_call, H] per layer, [T_call, V]
    with torch.no_grad():
        cache_hf = DynamicCache(config=hf.config)
        bounds = [0, p] + list(range(p + 1, len(seq) + 1))
        for start, stop in zip(bounds[:-1], bounds[1:]):
            out = hf(inputs_embeds=embeds[:, start:stop], cache=cache_hf, use_cache=True, output_hidden_states=True)
            ref_hidden.append([h[0] for h in out.hidden_states])
            ref_logits.append(out.logits[0])

    cache = KVCache.create(cfg, num_pages=16, page_size=4)
    ours_bounds = [0, 6, 15, p] + list(range(p + 1, len(seq) + 1))
    got_hidden: list[list[torch.Tensor]] = []
    got_logits: list[torch.Tensor] = []
    with torch.no_grad():
        for start, stop in zip(ours_bounds[:-1], ours_bounds[1:]):
            cache.allocator.reserve(0, stop)
            batch = step_batch([(0, seq, start, stop)])
            states, _ = ours.hidden_states(batch, cache, all_layers=True)
            got_hidden.append(states)
            got_logits.append(ours.text_logits(states[-1]))
    # regroup our prefill chunks into the reference's single prefill call
    n_chunks = 3
    prefill_hidden = [torch.cat([got_hidden[c][i] for c in range(n_chunks)]) for i in range(layers + 1)]
    got_hidden = [prefill_hidden] + got_hidden[n_chunks:]
    got_logits = [torch.cat(got_logits[:n_chunks])] + got_logits[n_chunks:]

    assert len(got_hidden) == len(ref_hidden) == 1 + 5
    worst_hidden = max(rel_err(g, r) for gs, rs in zip(got_hidden, ref_hidden) for g, r in zip(gs, rs, strict=True))
    worst_logits = max(rel_err(g, r) for g, r in zip(got_logits, ref_logits))
    assert worst_hidden <= TOL and worst_logits <= TOL, (worst_hidden, worst_logits)

    # forward(): audio logits = fused head at each step's last token; text logits via the tied head
    cache = KVCache.create(cfg, num_pages=16, page_size=4)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        cache.allocator.reserve(0, stop)
        out = ours(step_batch([(0, seq, start, stop)]), cache)
        last = ref_hidden[bounds.index(start)][-1][-1]  # reference final hidden at the step's last token
        expect_audio = (matrix @ last).view(K, V)
        assert out.audio_logits.dtype == torch.float32 and out.audio_logits.shape == (1, K, V)
        assert rel_err(out.audio_logits[0], expect_audio) <= TOL
        assert rel_err(out.text_logits[0], ref_logits[bounds.index(start)][-1]) <= TOL


def test_ragged_batch_mixes_prefill_and_decode(step_batch):
    """Two sequences: one decodes while the other prefills in the same call; each equals its solo run."""
    cfg = TalkerV3Config.tiny(num_layers=2)
    hf, ours = make_pair(cfg, seed=5)
    gen = torch.Generator().manual_seed(3)
    a, b = Seq(cfg, gen, 5, 9, 4), Seq(cfg, gen, 9, 12, 3)
    matrix = ours.audio.embedding.weight.detach()
    refs = []
    with torch.no_grad():
        for s in (a, b):
            refs.append(hf(inputs_embeds=s.embeds(hf, matrix)).logits[0])  # [T, V]
    cache = KVCache.create(cfg, num_pages=32, page_size=4)
    schedule = [  # (seq_id, seq, start, stop) per call
        [(0, a, 0, a.prompt_len)],
        [(0, a, a.prompt_len, a.prompt_len + 1), (1, b, 0, 10)],
        [(1, b, 10, b.prompt_len), (0, a, a.prompt_len + 1, a.prompt_len + 2)],
        [(0, a, a.prompt_len + 2, a.prompt_len + 3), (1, b, b.prompt_len, b.prompt_len + 1)],
    ]
    worst = 0.0
    for parts in schedule:
        for sid, s, _, stop in parts:
            cache.allocator.reserve(sid, stop)
        out = ours(step_batch(parts), cache)
        for row, (sid, _, _, stop) in enumerate(parts):
            worst = max(worst, rel_err(out.text_logits[row], refs[sid][stop - 1]))
    assert worst <= TOL


def test_fused_embedding_and_head_by_hand():
    """A matrix with small integer entries: embedding and head are exact sums/dot products."""
    cfg = TalkerV3Config.tiny(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2)
    model = TalkerV3(cfg)
    rows = torch.arange(K * V, dtype=torch.float32)
    matrix = torch.stack([(rows * (j + 1)) % 7 - 3 for j in range(8)], dim=1)  # [8208, 8], entries in -3..3
    with torch.no_grad():
        model.audio.embedding.weight.copy_(matrix)
    codes = torch.tensor([[0, 1, 2, 3, 1023, 1024, 1025, 5], [1024] * 8])
    got = model.audio.embed(codes)
    # row 0: matrix[0] + matrix[1026+1] + matrix[2052+2] + ... + matrix[7*1026+5]
    expect0 = sum(matrix[k * V + int(codes[0, k])] for k in range(K))
    expect1 = sum(matrix[k * V + 1024] for k in range(K))
    assert torch.equal(got, torch.stack([expect0, expect1]))
    # entry by entry for row 0, column 0: (r * 1) % 7 - 3 for r = 0, 1027, 2054, 3081, 5127, 6154, 7181, 7187
    assert got[0, 0].item() == sum((r % 7) - 3 for r in (0, 1027, 2054, 3081, 5127, 6154, 7181, 7187))

    hidden = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 2.0]])
    logits = model.audio.logits(hidden)
    assert logits.shape == (1, K, V) and logits.dtype == torch.float32
    for k, v in [(0, 0), (3, 17), (7, 1025)]:
        r = k * V + v
        assert logits[0, k, v].item() == ((r % 7) - 3) + 2 * ((r * 8) % 7 - 3)


def test_audio_rows_take_fused_embedding_not_the_text_id():
    """At an <|audio|> decode step the input is fused(previous row); the text id there is ignored."""
    cfg = TalkerV3Config.tiny()
    _, ours = make_pair(cfg, seed=2)
    codes = torch.tensor([[5, 1024, 1024, 1024, 1024, 1024, 1024, 1024], [0] * 8])
    ids = torch.tensor([cfg.special.audio, cfg.special.audio])
    x = ours.embed(ids, codes, torch.tensor([True, False]))
    matrix = ours.audio.embedding.weight.detach()
    assert torch.equal(x[0], fused_by_hand(matrix, codes[:1])[0])
    assert torch.equal(x[1], ours.text_embedding.weight[cfg.special.audio])


def test_bf16_checkpoint_keeps_audio_matrix_dtype_and_fp32_logits():
    cfg = TalkerV3Config.tiny()
    model = TalkerV3(cfg).to(torch.bfloat16)
    assert model.audio.embedding.weight.dtype == torch.bfloat16
    h = torch.randn(2, cfg.hidden_size, dtype=torch.bfloat16)
    logits = model.audio.logits(h)
    assert logits.dtype == torch.float32
    expect = (h @ model.audio.embedding.weight.T).float().view(2, K, V)  # bf16 matmul, then fp32
    assert torch.equal(logits, expect)
