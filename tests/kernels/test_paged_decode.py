"""The Triton paged decode attention (kernels/paged_decode.py) run by Triton's interpreter on the CPU in fp32:
equal to its plain-torch definition, which equals the ragged reference `paged_attention_ref` at qo_len 1, on
fragmented page tables with partly filled last pages, GQA groups of 1 to 4, and blocks of part of a page (pages of 24)
to four pages, whole or ranged (ranges of 2 blocks shared by 1 or 3 programs: some programs get no range); the ranged
form's output does not depend on the batch or the program count, bit for bit (16-bit and e4m3 pages on the GPU:
tests/kernels/test_paged_decode_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch

from higgs_stream.kernels import paged_decode as pd
from higgs_stream.kernels.attention import PagedLayout, paged_attention_ref

SCRIPT = r"""
import itertools, json, torch
from higgs_stream.kernels import paged_decode as pd
from higgs_stream.kernels.attention import PagedLayout
g = torch.Generator().manual_seed(0)
out = []
for (hq, hkv, d, page, block_n), ranged in itertools.product(
        ((6, 2, 16, 4, 16), (4, 2, 32, 16, 32), (8, 8, 16, 16, 64), (4, 1, 16, 24, 16)), (None, 1, 3)):
    k, v = torch.randn(40, page, hkv, d, generator=g), torch.randn(40, page, hkv, d, generator=g)
    lens = [1, page, page + 1, 3 * page + 2, 7 * page]
    perm, tables, at = torch.randperm(40, generator=g).tolist(), [], 0
    for n in lens:
        tables.append(perm[at:at + -(-n // page)])
        at += len(tables[-1])
    lay = PagedLayout.build(tables, lens, [1] * len(lens), page)
    q = torch.randn(len(lens), hq, d, generator=g) * 2
    csr = (lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len)
    ranges = dict(max_kv_len=7 * page + 5, programs=ranged, range_tokens=2 * block_n) if ranged else {}
    got = pd.launch(q, k, v, *csr, d ** -0.5, block_n=block_n, **ranges)
    want = pd.paged_decode_ref(q, k, v, *csr, d ** -0.5)
    same = True
    if ranged:  # sequence 3 alone (its own CSR), and the whole batch with another program count: the same bits
        alone = PagedLayout.build(tables[3:4], lens[3:4], [1], page)
        one = pd.launch(q[3:4].contiguous(), k, v, alone.kv_indptr, alone.kv_indices, alone.kv_last_page_len,
                        d ** -0.5, block_n=block_n, **ranges)
        other = pd.launch(q, k, v, *csr, d ** -0.5, block_n=block_n, **{**ranges, "programs": 4 - ranged})
        same = torch.equal(one[0], got[3]) and torch.equal(other, got)
    out.append([(got - want).abs().max().item(), want.abs().max().item(), same])
print(json.dumps(out))
"""


def test_kernel_in_the_interpreter(interpret):
    res = interpret(SCRIPT)
    assert len(res) == 12
    for err, peak, same in res:
        assert err < 1e-5 * max(peak, 1.0) and peak > 0.5, (err, peak)  # fp32 rounding of O(1) outputs
        assert same


WORDS_SCRIPT = r"""
import json, torch, triton, triton.language as tl
from higgs_stream.kernels import paged_decode as pd
pd.tl = tl  # the interpreter wants triton.language among a device function's globals; paged_decode imports it lazily
words_in_order = pd._words_in_order()

@triton.jit
def bytes_back(words_ptr, out_ptr, ROWS: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, ROWS)
    w = tl.load(words_ptr + r[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :])
    # byte k of each word in the k-th tensor, as the widening hands them over
    out = words_in_order(w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF, (w >> 24) & 0xFF, ROWS, D)
    tl.store(out_ptr + r[:, None] * D + tl.arange(0, D)[None, :], out)

raw = torch.randint(0, 256, (16, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
out = torch.empty(16, 64, dtype=torch.int32)
bytes_back[(1,)](raw.view(torch.int32), out, ROWS=16, D=64)
print(json.dumps(torch.equal(out, raw.int())))
"""


def test_words_come_back_in_memory_order(interpret):
    """The e4m3 words form's reassembly (its widening is inline PTX, which the interpreter cannot run: the GPU tests
    check that): four tensors holding byte 0, 1, 2, 3 of each little-endian 4-byte word come back as the bytes in
    memory order. Session 21's first build nested the joins the other way (bytes 0, 2, 1, 3) and only a GPU run
    showed it."""
    assert interpret(WORDS_SCRIPT) is True


def test_definition_equals_the_ragged_reference():
    """`paged_decode_ref` is `paged_attention_ref` with every qo_len 1 (fp32, GQA group 3, fragmented pages)."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(30, 8, 2, 16, generator=g), torch.randn(30, 8, 2, 16, generator=g)
    lens = [3, 8, 9, 40]
    perm = torch.randperm(30, generator=g).tolist()
    tables = [perm[0:1], perm[1:2], perm[2:4], perm[4:9]]
    lay = PagedLayout.build(tables, lens, [1] * 4, 8)
    q = torch.randn(4, 6, 16, generator=g)
    got = pd.paged_decode_ref(q, k, v, lay.kv_indptr, lay.kv_indices, lay.kv_last_page_len, 0.25)
    want = paged_attention_ref(q, k, v, lay, 0.25)
    assert (got - want).abs().max().item() < 1e-6
    assert pd.kv_lens_of(lay.kv_indptr, lay.kv_last_page_len, 8).tolist() == lens



def test_the_launch_refuses_a_strided_layout():
    """The kernel reads the CSR tensors by element offsets: a stride-0 page list (an expanded view) is refused before
    any launch, not read past its one element (session 24's illegal address at one Qwen3-TTS stream)."""
    q, k, v = torch.zeros(2, 4, 16), torch.zeros(1, 16, 2, 16), torch.zeros(1, 16, 2, 16)
    indptr, last = torch.arange(3, dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    pages = torch.zeros(1, 1, dtype=torch.int32).expand(1, 2).reshape(-1)  # [0, 0] as a view of one element
    assert pages.stride() == (0,)
    with pytest.raises(AssertionError, match="contiguous CSR"):
        pd.launch(q, k, v, indptr, pages, last, 0.25)


# the served configuration: v2's heads, a group of 3 padded to 16, head 128, pages of 16, 64 tokens a block,
# the whole form
CONSTS = {"HKV": 8, "GROUP": 3, "GROUP_PAD": 16, "D": 128, "PAGE": 16, "BLOCK_N": 64, "PROGRAMS": 1, "RANGE": 0,
          "SLOTS": 1, "FP8_WORDS": False}


def signature(pool: str) -> dict[str, str]:
    return {"q_ptr": "*bf16", "k_ptr": pool, "v_ptr": pool, "o_ptr": "*bf16", "part_ptr": "*fp32", "ml_ptr": "*fp32",
            "indptr_ptr": "*i32", "indices_ptr": "*i32", "last_ptr": "*i32", "scale_log2": "fp32",
            **dict.fromkeys(CONSTS, "constexpr")}


@pytest.mark.parametrize("pool", ["*bf16", "*fp8e4nv"])
def test_the_kernel_compiles_for_hopper(pool, compile_for_hopper):
    """The served configuration (CONSTS, 4 warps, 1 stage) compiles for sm_90 over bf16 and e4m3 pages (those as
    words), whole and ranged (16 programs, 64 slots of 64 tokens) with the merge, no GPU needed."""
    sig = signature(pool)
    consts = {**CONSTS, "FP8_WORDS": pool == "*fp8e4nv"}
    ptx = compile_for_hopper(pd._kernel(), sig, consts, num_warps=4, num_stages=1).asm["ptx"]
    ranged = compile_for_hopper(pd._kernel(), sig, {**consts, "PROGRAMS": 16, "RANGE": 64, "SLOTS": 64}, num_warps=4,
                                num_stages=1)
    merge = compile_for_hopper(pd._merge_kernel(), {"part_ptr": "*fp32", "ml_ptr": "*fp32", "o_ptr": "*bf16",
                               "indptr_ptr": "*i32", "last_ptr": "*i32", "D": "constexpr", "PAGE": "constexpr",
                               "RANGE": "constexpr", "SLOTS": "constexpr", "SLOTS_PAD": "constexpr"},
                               {"D": 128, "PAGE": 16, "RANGE": 64, "SLOTS": 64, "SLOTS_PAD": 64}, num_warps=4)
    assert ranged.asm["cubin"] and merge.asm["cubin"]  # ranged: the partial sums and their merge
    assert "mma" in ptx  # the scores and P @ V on tensor cores


def test_e4m3_values_reach_the_tensor_cores_as_16_bit_words(compile_for_hopper):
    """Over e4m3 pages the served form widens V where it was loaded (4-byte words, the exact e4m3 -> fp16 conversion,
    two values an instruction) and hands the fp16 tile to the tensor cores through transposing matrix loads, as over
    bf16 pages: no byte-wise loads from shared memory (the cast form read V's tile back one byte at a time to
    transpose it: 64 one-byte loads a thread per block of 64 tokens, sm_90, Triton 3.6)."""
    ptx = compile_for_hopper(pd._kernel(), signature("*fp8e4nv"), {**CONSTS, "FP8_WORDS": True}, num_warps=4,
                             num_stages=1).asm["ptx"]
    assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert not re.search(r"ld\.shared(\.v\d)?\.(b8|u8|s8)", ptx)


def test_programs_per_batch():
    """The ranged form's programs per sequence and head: 16 at 1-4 rows of v2's 8 K/V heads, 4 at 16, 1 from 64
    (module docstring); never more than 16, never fewer than 1."""
    assert [pd.decode_splits(b, 8) for b in (1, 2, 4, 8, 16, 32, 64, 256)] == [16, 16, 16, 8, 4, 2, 1, 1]
    assert pd.decode_splits(1, 1) == 16 and pd.decode_splits(1000, 64) == 1
