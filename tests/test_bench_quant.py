"""The quantization benchmark's flow on the CPU (higgs_stream/bench_quant.py --dry-run: tiny model,
plain-torch kernels, fp8 emulated, no timings), and its target checks and table on made-up numbers."""

from __future__ import annotations

import json

from higgs_stream import bench_quant


def test_dry_run_reports_every_mode(tmp_path, capsys):
    out = tmp_path / "quant.json"
    assert bench_quant.main(["--dry-run", "--out", str(out), "--modes", "none,fp8,int8,none/kv8",
                             "--graph-buckets", "1,2,16,64"]) == 0
    r = json.loads(out.read_text())
    assert all(m["graph_buckets"] == [1, 2, 16, 64] for m in r["model"].values())
    assert set(r["model"]) == {"none", "fp8", "int8", "none/kv8"} and "gemm" not in r
    assert r["model"]["none/kv8"]["kv_cache_dtype"] == "fp8" and r["model"]["none/kv8"]["quantized"]["linears"] == 0
    for mode, m in r["model"].items():
        assert m["eos_suppressed"]["length"] == m["eos_suppressed"]["streams"] and m["eos_suppressed"]["length_at_cap"]
        assert m["eos_reachable"]["all_ended_by_eos_or_cap"] and m["eos_reachable"]["runaway"] == 0
        p = m["parity_random_columns"]
        assert (p["mean_abs_delta_nat"] < 1e-5) == (mode == "none"), (mode, p)
        assert (m["quantized"]["linears"] > 0) == (m["quantize"] != "none")
    assert r["model"]["int8"]["audio_step_weight_bytes"] < r["model"]["none"]["audio_step_weight_bytes"]
    assert "[fp8] weights" in capsys.readouterr().out


def test_targets_and_table():
    def decode(b1, b256, floor):
        return [{"batch": 1, "replay_ms": b1, "floor_weights_kv_ms": floor, "replay_over_floor": b1 / floor},
                {"batch": 256, "replay_ms": b256, "floor_weights_kv_ms": 2 * floor, "replay_over_floor": b256 / floor}]

    modes = {"none": {"decode": decode(3.4, 8.3, 1.9)}, "fp8": {"decode": decode(1.9, 5.9, 1.0)}}
    t = bench_quant.targets(modes)
    assert t["fp8_b1_ms"]["met"] and not t["fp8_b1_over_floor"]["met"]  # 1.9 ms, 1.9x its floor
    assert t["fp8_b256_over_bf16"]["value"] == 5.9 / 8.3 and t["fp8_b256_over_bf16"]["met"]
    assert bench_quant.targets({"none": modes["none"]}) == {}
    row = {"linear": "qkv", "n": 5120, "k": 3072, "m": 1, "floor_us": {"bf16": 10.0, "int8": 5.0, "fp8": 5.0},
           "bf16_cublas": 12.0, "fp8_triton_quant_scaled_mm": 8.0}
    bench_quant.summarize({"card": "x", "copy_bandwidth_GBps": 3000.0, "torchao": "0.18.0",
                           "gemm": [row, dict(row, m=256, fp8_triton_quant_scaled_mm=None)], "targets": t})


def test_merge_joins_one_process_per_mode(tmp_path):
    """scripts/gpu_quant.sh runs each mode in its own process; --merge makes one result with targets."""
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "quant.json"
    assert bench_quant.main(["--dry-run", "--out", str(a), "--modes", "none"]) == 0
    assert bench_quant.main(["--dry-run", "--out", str(b), "--modes", "int8"]) == 0
    assert bench_quant.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["modes"] == ["none", "int8"] and r["model"]["int8"] == json.loads(b.read_text())["model"]["int8"]
    assert r["targets"] == {} and r["card"] == "cpu (dry run)"
