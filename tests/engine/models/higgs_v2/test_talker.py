"""Talker parity with transformers' HiggsAudioV2ForConditionalGeneration (fp32, CPU, tiny random).

The reference is run the way its own code routes positions: `<|AUDIO_OUT|>` placeholders in
input_ids are replaced by the summed codebook embeddings of `audio_input_ids` and take the audio
norms/MLP; a decode step given only `audio_input_ids` is all-audio. Its audio logits are
`audio_lm_head(model(...).last_hidden_state)` (what `forward` returns) and text logits
`text_lm_head` on the same hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache, HiggsAudioV2Config, HiggsAudioV2ForConditionalGeneration

from higgs_stream.engine.errors import InvalidInputError
from higgs_stream.engine.kv_cache import KVCache
from higgs_stream.engine.models.higgs_v2.config import TalkerConfig
from higgs_stream.engine.models.higgs_v2.talker import Talker

TOL = 1e-5
HEADS = [(4, 2), (4, 1), (4, 4)]  # (query heads, kv heads)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def make_pair(cfg: TalkerConfig, seed: int = 0) -> tuple[HiggsAudioV2ForConditionalGeneration, Talker]:
    """Random HF model (weights scaled so attention is far from uniform) and our Talker loaded from it."""
    torch.manual_seed(seed)
    hf_cfg = HiggsAudioV2Config(**cfg.to_hf_dict(), audio_delay_token_id=cfg.vocab_size - 1)
    hf = HiggsAudioV2ForConditionalGeneration(hf_cfg, use_text_head=True).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:  # norms: distinct text/audio weights
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.5 * p.shape[1] ** -0.5)
    ours = Talker(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@dataclass
class Seq:
    """A token sequence: text ids where not is_audio, one code column per audio position."""

    ids: torch.Tensor  # [T] long
    codes: torch.Tensor  # [T, 8] long
    is_audio: torch.Tensor  # [T] bool

    def __len__(self) -> int:
        return self.ids.shape[0]


def make_seq(cfg: TalkerConfig, gen: torch.Generator, n_text: int, n_audio: int, tail_text: int = 0) -> Seq:
    """text + <|audio_out_bos|> + audio columns (incl. stream BOS/EOS ids) [+ <|audio_eos|> + text]."""
    s = cfg.special
    parts = [torch.randint(0, 256, (n_text,), generator=gen), torch.tensor([s.audio_out_bos])]
    audio_ids = torch.full((n_audio,), s.audio_out)
    parts.append(audio_ids)
    if tail_text:
        parts += [torch.tensor([s.audio_eos]), torch.randint(0, 256, (tail_text - 1,), generator=gen)]
    ids = torch.cat(parts)
    is_audio = ids == s.audio_out
    codes = torch.randint(0, cfg.codebook_size, (len(ids), cfg.num_codebooks), generator=gen)
    audio_rows = is_audio.nonzero().flatten()
    if n_audio >= 2:  # a delay-pattern head and tail: BOS ramp at the start, EOS at the end
        codes[audio_rows[0]] = cfg.audio_stream_bos_id
        codes[audio_rows[1], 1:] = cfg.audio_stream_bos_id
        codes[audio_rows[-1]] = cfg.audio_stream_eos_id
    codes[~is_audio] = 0
    return Seq(ids, codes, is_audio)


def hf_full_logits(hf, cfg: TalkerConfig, seq: Seq) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference logits at every position of `seq`: audio [T, 8, 1026], text [T, V]."""
    n_audio = int(seq.is_audio.sum())
    kwargs = {}
    if n_audio:
        kwargs = dict(audio_input_ids=seq.codes[seq.is_audio][None],
                      audio_input_ids_mask=torch.ones(1, n_audio, dtype=torch.bool))
    with torch.no_grad():
        hidden = hf.model(input_ids=seq.ids[None], **kwargs).last_hidden_state[0]  # [T, H]
        return hf.audio_lm_head(hidden).view(len(seq), cfg.num_codebooks, cfg.audio_vocab), hf.text_lm_head(hidden)


@pytest.mark.parametrize("heads", HEADS)
def test_state_dict_keys_equal_hf(heads):
    cfg = TalkerConfig.tiny(num_heads=heads[0], num_kv_heads=heads[1])
    hf, ours = make_pair(cfg)
    assert set(ours.state_dict()) == set(hf.state_dict())
    assert "model.embed_audio_tokens.embed_audio_tokens.weight" in ours.state_dict()
    assert ours.state_dict()["audio_lm_head.weight"].shape == (8 * 1026, cfg.hidden_size)


@pytest.mark.parametrize("heads,layers", [(HEADS[0], 2), (HEADS[1], 3), (HEADS[2], 2)])
def test_prefill_every_position_matches_hf(heads, layers, step_batch):
    """Sequence t of the batch is the prompt's prefix of length t+1, so one ragged prefill call
    returns our logits at every prompt position; compare with the reference's full forward."""
    cfg = TalkerConfig.tiny(num_heads=heads[0], num_kv_heads=heads[1], num_layers=layers)
    hf, ours = make_pair(cfg, seed=layers)
    seq = make_seq(cfg, torch.Generator().manual_seed(1), n_text=9, n_audio=12, tail_text=4)
    ref_audio, ref_text = hf_full_logits(hf, cfg, seq)

    cache = KVCache.create(cfg, num_pages=128, page_size=4)
    for t in range(len(seq)):
        cache.allocator.reserve(t, t + 1)
    out = ours(step_batch([(t, seq, 0, t + 1) for t in range(len(seq))]), cache)
    assert out.audio_logits.dtype == torch.float32 and out.audio_logits.shape == (len(seq), 8, 1026)
    assert rel_err(out.audio_logits, ref_audio) <= TOL
    assert rel_err(out.text_logits, ref_text) <= TOL


@pytest.mark.parametrize("heads", HEADS)
def test_chunked_prefill_then_decode_matches_hf_cache(heads, step_batch):
    """Ours: prompt in chunks 5/7/rest, then 1-token steps; reference: one cached prefill, then its
    cached decode path (audio steps passed as audio_input_ids only, text steps as input_ids)."""
    cfg = TalkerConfig.tiny(num_heads=heads[0], num_kv_heads=heads[1])
    hf, ours = make_pair(cfg, seed=7)
    gen = torch.Generator().manual_seed(2)
    prompt = make_seq(cfg, gen, n_text=8, n_audio=10)
    n_prompt = len(prompt)
    # decode continuation: 6 audio columns (incl. BOS/EOS ids), then <|audio_eos|> and 2 text tokens
    dec_codes = torch.randint(0, 1024, (9, 8), generator=gen)
    dec_codes[1, :3] = cfg.audio_stream_bos_id
    dec_codes[5, 4:] = cfg.audio_stream_eos_id
    dec_is_audio = torch.tensor([True] * 6 + [False] * 3)
    dec_ids = torch.tensor([cfg.special.audio_out] * 6 + [cfg.special.audio_eos, 17, 99])
    dec_codes[~dec_is_audio] = 0
    seq = Seq(torch.cat([prompt.ids, dec_ids]), torch.cat([prompt.codes, dec_codes]),
              torch.cat([prompt.is_audio, dec_is_audio]))

    # reference
    ref_audio, ref_text = [], []
    with torch.no_grad():
        cache_hf = DynamicCache(config=hf.config)
        n_audio = int(prompt.is_audio.sum())
        hidden = hf.model(input_ids=prompt.ids[None], audio_input_ids=prompt.codes[prompt.is_audio][None],
                          audio_input_ids_mask=torch.ones(1, n_audio, dtype=torch.bool),
                          cache=cache_hf, use_cache=True).last_hidden_state[0, -1:]
        ref_audio.append(hf.audio_lm_head(hidden))
        ref_text.append(hf.text_lm_head(hidden))
        for j in range(len(dec_ids)):
            if dec_is_audio[j]:
                step = dict(audio_input_ids=dec_codes[j][None, None])
            else:
                step = dict(input_ids=dec_ids[j][None, None])
            hidden = hf.model(**step, cache=cache_hf, use_cache=True).last_hidden_state[0, -1:]
            ref_audio.append(hf.audio_lm_head(hidden))
            ref_text.append(hf.text_lm_head(hidden))
    ref_audio = torch.cat(ref_audio).view(-1, 8, 1026)
    ref_text = torch.cat(ref_text)

    # ours
    cache = KVCache.create(cfg, num_pages=32, page_size=4)
    got_audio, got_text = [], []
    bounds = [0, 5, 12, n_prompt] + list(range(n_prompt + 1, len(seq) + 1))
    for start, stop in zip(bounds[:-1], bounds[1:]):
        cache.allocator.reserve(0, stop)
        out = ours(step_batch([(0, seq, start, stop)]), cache)
        if stop >= n_prompt:
            got_audio.append(out.audio_logits)
            got_text.append(out.text_logits)
    assert rel_err(torch.cat(got_audio), ref_audio) <= TOL
    assert rel_err(torch.cat(got_text), ref_text) <= TOL


def test_batched_mixed_prefill_and_decode_match_each_alone(step_batch):
    """Four sequences of different lengths share a fragmented page pool; every call mixes prefill
    chunks of some with decode steps of others (one joins late). Logits at each chunk end equal
    the reference's forward over that sequence alone."""
    cfg = TalkerConfig.tiny(num_layers=3)
    hf, ours = make_pair(cfg, seed=3)
    gen = torch.Generator().manual_seed(4)
    seqs = [make_seq(cfg, gen, 6, 14), make_seq(cfg, gen, 3, 4), make_seq(cfg, gen, 11, 17, tail_text=3),
            make_seq(cfg, gen, 2, 9)]
    prompt_chunks = [[7, 9], [4], [5, 12, 12], [6]]  # sum = len(seq) - decode steps
    n_decode = [5, 4, 3, 6]
    join_step = [0, 0, 1, 3]
    refs = [hf_full_logits(hf, cfg, s) for s in seqs]

    cache = KVCache.create(cfg, num_pages=64, page_size=4)
    cache.allocator.reserve(99, 4 * 13)  # fragment the free list, then give it back
    cache.allocator.reserve(98, 8)
    cache.allocator.free(99)
    schedules = []
    for s, chunks, nd in zip(seqs, prompt_chunks, n_decode):
        assert sum(chunks) + nd == len(s)
        schedules.append(chunks + [1] * nd)
    cursor = [0] * 4
    done = [0] * 4
    worst = 0.0
    step = 0
    while any(done[i] < len(schedules[i]) for i in range(4)):
        parts = []
        for i in range(4):
            if step >= join_step[i] and done[i] < len(schedules[i]):
                stop = cursor[i] + schedules[i][done[i]]
                cache.allocator.reserve(10 + i, stop)
                parts.append((10 + i, seqs[i], cursor[i], stop))
        out = ours(step_batch(parts), cache)
        for row, (sid, _, _, stop) in enumerate(parts):
            i = sid - 10
            worst = max(worst, rel_err(out.audio_logits[row], refs[i][0][stop - 1]),
                        rel_err(out.text_logits[row], refs[i][1][stop - 1]))
            cursor[i], done[i] = stop, done[i] + 1
        step += 1
    assert worst <= TOL
    for i in range(4):
        assert cache.allocator.seq_len(10 + i) == len(seqs[i])
        cache.allocator.free(10 + i)
    cache.allocator.free(98)
    assert cache.allocator.num_used == 0


def count_calls(modules: dict[str, torch.nn.Module]) -> dict[str, int]:
    counts = {name: 0 for name in modules}
    for name, module in modules.items():
        module.register_forward_hook(lambda *_, n=name: counts.__setitem__(n, counts[n] + 1))
    return counts


def test_branches_run_only_for_their_rows(step_batch):
    cfg = TalkerConfig.tiny()
    _, ours = make_pair(cfg)
    layer = ours.model.layers[0]
    counts = count_calls({"mlp": layer.mlp, "text_norm": layer.input_layernorm, "audio_mlp": layer.audio_mlp,
                          "embed_tokens": ours.model.embed_tokens, "text_head": ours.text_lm_head,
                          "audio_head": ours.audio_lm_head})
    seq = make_seq(cfg, torch.Generator().manual_seed(5), n_text=4, n_audio=4)
    cache = KVCache.create(cfg, num_pages=8, page_size=4)
    cache.allocator.reserve(0, 5)
    ours(step_batch([(0, seq, 0, 5)], want_text=False), cache)  # text-only prefill
    assert counts == {"mlp": 1, "text_norm": 1, "audio_mlp": 0, "embed_tokens": 1, "text_head": 0, "audio_head": 1}
    cache.allocator.reserve(0, 9)
    out = ours(step_batch([(0, seq, 5, 9)], want_text=False), cache)  # audio-only decode-like step
    assert counts == {"mlp": 1, "text_norm": 1, "audio_mlp": 1, "embed_tokens": 1, "text_head": 0, "audio_head": 2}
    assert out.text_logits is None


def test_want_flags_select_rows(step_batch):
    cfg = TalkerConfig.tiny()
    _, ours = make_pair(cfg)
    seq = make_seq(cfg, torch.Generator().manual_seed(6), n_text=3, n_audio=3)
    cache = KVCache.create(cfg, num_pages=8, page_size=4)
    cache.allocator.reserve(0, 4)
    cache.allocator.reserve(1, 7)
    batch = step_batch([(0, seq, 0, 4), (1, seq, 0, 7)])
    batch.want_audio = torch.tensor([False, True])
    batch.want_text = torch.tensor([True, False])
    out = ours(batch, cache)
    assert out.audio_logits[0].isnan().all() and out.audio_logits[1].isfinite().all()
    assert out.text_logits[0].isfinite().all() and out.text_logits[1].isnan().all()


def test_bad_batches_raise_typed_errors(step_batch):
    cfg = TalkerConfig.tiny()
    _, ours = make_pair(cfg)
    seq = make_seq(cfg, torch.Generator().manual_seed(8), n_text=2, n_audio=2)
    cache = KVCache.create(cfg, num_pages=8, page_size=4)
    cache.allocator.reserve(0, len(seq))
    bad_code = step_batch([(0, seq, 0, len(seq))])
    bad_code.audio_codes[-1, 3] = cfg.audio_vocab  # 1026 is out of range
    with pytest.raises(InvalidInputError, match="audio codes"):
        ours(bad_code, cache)
    bad_text = step_batch([(0, seq, 0, len(seq))])
    bad_text.input_ids[0] = cfg.vocab_size
    with pytest.raises(InvalidInputError, match="text ids"):
        ours(bad_text, cache)
    bad_len = step_batch([(0, seq, 0, len(seq))])
    bad_len.qo_lens = [len(seq) - 1]
    with pytest.raises(InvalidInputError):
        ours(bad_len, cache)
    no_head = Talker(cfg, use_text_head=False)
    with pytest.raises(InvalidInputError, match="text head"):
        no_head(step_batch([(0, seq, 0, len(seq))]), cache)
