"""Programmatic dependent launch (kernels/_triton.py): the switch, and the compiled kernels' order of instructions
(sm_90, Triton's bundled ptxas and nvdisasm, no GPU): with PDL every decode-step kernel waits for the kernel before
(`griddepcontrol.wait`, SASS `ACQBULK`) before its first global load or store, and only then lets the next kernel
launch (`griddepcontrol.launch_dependents`, SASS `PREEXIT`); without PDL neither instruction is there."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from higgs_stream.kernels import _triton

MEMORY = re.compile(r"\b(LDG|STG|LDGSTS|ATOMG|RED|LD|ST|UBLKCP|UTMALDG)\b")


def sass(compiled) -> list[str]:
    """The kernel's SASS instructions, in order."""
    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):  # pragma: no cover - a Triton without its CUDA tools
        pytest.skip("no nvdisasm")
    path = f"/tmp/higgs_pdl_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        out = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*);", out)]


def kernels():
    """(name, jit function, signature, constexprs) of decode-step kernels at v2's served shapes."""
    from higgs_stream.kernels import fused_norm, int8_linear, paged_decode, rope_kv

    gemv_sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32",
                **dict.fromkeys(("K", "ROWS", "ROWS_PAD", "BLOCK_N", "BLOCK_K", "W_FLOAT", "PDL"),
                                "constexpr")}
    gemv_consts = {"K": 8192, "ROWS": 1, "ROWS_PAD": 1, "BLOCK_N": 8, "BLOCK_K": 2048, "W_FLOAT": True}
    norm_sig = {"delta_ptr": "*bf16", "res_ptr": "*fp32", "w_ptr": "*bf16", "sel_ptr": "*i64", "out_ptr": "*bf16",
                "scale_ptr": "*fp32", "H": "i32", "eps": "fp32", "q_eps": "fp32", "inv_fp8_max": "fp32",
                "fp8_max": "fp32", **dict.fromkeys(("HAS_DELTA", "HAS_SELECT", "QUANT", "BLOCK", "PDL"), "constexpr")}
    norm_consts = {"HAS_DELTA": True, "HAS_SELECT": False, "QUANT": False, "BLOCK": 4096}
    merge_sig = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "o_ptr": "*bf16", "indptr_ptr": "*i32", "last_ptr": "*i32",
                 **dict.fromkeys(("D", "PAGE", "RANGE", "SLOTS", "SLOTS_PAD", "PDL"), "constexpr")}
    merge_consts = {"D": 128, "PAGE": 16, "RANGE": 64, "SLOTS": 64, "SLOTS_PAD": 64}
    decode_consts = {"HKV": 8, "GROUP": 3, "GROUP_PAD": 16, "D": 128, "PAGE": 16, "BLOCK_N": 64, "PROGRAMS": 16,
                     "RANGE": 64, "SLOTS": 64, "FP8_WORDS": True}  # the ranged form over e4m3 pages read as words
    decode_sig = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "o_ptr": "*bf16", "part_ptr": "*fp32",
                  "ml_ptr": "*fp32", "indptr_ptr": "*i32", "indices_ptr": "*i32", "last_ptr": "*i32",
                  "scale_log2": "fp32", **dict.fromkeys((*decode_consts, "PDL"), "constexpr")}
    rope_consts = {"HQ": 24, "HKV": 8, "D": 128, "KV_FP8": True, "KV_MAX": 448.0, "QK_NORM": False}
    rope_sig = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64", "q_ptr": "*bf16",
                "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "w_ptr": "*bf16", "eps": "fp32",
                **dict.fromkeys((*rope_consts, "PDL"), "constexpr")}
    _, norm = fused_norm._kernel()
    return [("gemv", int8_linear.build_gemv_kernel(), gemv_sig, gemv_consts),
            ("add_rms_norm", norm, norm_sig, norm_consts),
            ("paged_decode", paged_decode._kernel(), decode_sig, decode_consts),
            ("merge_splits", paged_decode._merge_kernel(), merge_sig, merge_consts),
            ("rope_store_kv", rope_kv._kernel(), rope_sig, rope_consts)]


def test_the_switch_sets_both_launch_arguments():
    assert _triton.pdl_args() == {"PDL": False, "launch_pdl": False}  # off by default
    with _triton.pdl(True):
        assert _triton.pdl_args() == {"PDL": True, "launch_pdl": True}
    assert _triton.pdl_args() == {"PDL": False, "launch_pdl": False}


def test_the_block_form_restores_the_switch_even_on_an_error():
    with _triton.pdl(True):
        assert _triton.pdl_args()["PDL"]
        with _triton.pdl(False):
            assert not _triton.pdl_args()["PDL"]
        assert _triton.pdl_args()["PDL"]  # the outer block's again
    assert not _triton.pdl_args()["PDL"]
    with pytest.raises(RuntimeError, match="capture failed"), _triton.pdl(True):
        raise RuntimeError("capture failed")
    assert _triton.pdl_args() == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("which", ["gemv", "add_rms_norm", "paged_decode", "merge_splits", "rope_store_kv"])
def test_with_pdl_the_kernel_waits_before_any_memory_access(which, compile_for_hopper):
    pytest.importorskip("triton")
    name, fn, sig, consts = next(k for k in kernels() if k[0] == which)
    on = compile_for_hopper(fn, sig, {**consts, "PDL": True}, launch_pdl=True)
    assert on.metadata.launch_pdl  # the launcher sets CUDA's programmatic stream serialization attribute
    code = sass(on)
    wait = next(i for i, ins in enumerate(code) if ins.startswith("ACQBULK"))
    release = next(i for i, ins in enumerate(code) if ins.startswith("PREEXIT"))
    first_memory = next(i for i, ins in enumerate(code) if MEMORY.search(ins))
    assert wait < release and wait < first_memory, (name, code[: first_memory + 1])
    off = sass(compile_for_hopper(fn, sig, {**consts, "PDL": False}))
    assert not any(ins.startswith(("ACQBULK", "PREEXIT")) for ins in off)
