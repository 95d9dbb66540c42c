"""The in-process benchmark's trace summary (higgs_stream/bench/): where a run's time went."""

import pytest
from higgs_stream.bench import trace_summary


def test_trace_summary_splits_steps_and_finds_those_beside_a_codec_call():
    trace = [  # (kind, t0, t_step, t_end, rows, wait) for steps; (kind, t0, t1, jobs, frames, steps) for calls
        ("step", 0.000, 0.004, 0.005, 8, 0.001),
        ("codec", 0.0045, 0.012, 3, 75, 1),
        ("step", 0.005, 0.013, 0.014, 8, 0.006),  # overlaps the call
        ("step", 0.020, 0.024, 0.025, 8, 0.001, 2),  # two prompt chunks in this step
        ("codec", 0.030, 0.031, 1, 25, 3, True),  # two steps in this call (partition); it held an overdue job
    ]
    s = trace_summary(trace, wall_s=0.05)
    assert s["steps"] == 3 and s["codec_calls"] == 2 and s["codec_steps"] == 3
    assert s["engine_host_ms"] == pytest.approx((3 + 2 + 3) / 3)  # engine.step minus device waits
    assert s["engine_wait_ms"] == pytest.approx((1 + 6 + 1) / 3)
    assert s["route_ms"] == pytest.approx(1.0)
    assert s["share_of_steps_with_codec"] == pytest.approx(2 / 3)  # the first step ends after the call starts
    assert s["step_ms_with_codec"] == pytest.approx((5 + 9) / 2)
    assert s["step_ms_without_codec"] == pytest.approx(5.0)
    assert s["codec_frames_mean"] == pytest.approx(50.0)
    assert s["codec_busy_share"] == pytest.approx((0.0075 + 0.001) / 0.05)
    assert s["step_ms_with_prefill"] == pytest.approx(5.0) and s["share_of_steps_with_prefill"] == pytest.approx(1 / 3)
    assert s["step_ms_without_prefill"] == pytest.approx((5 + 9) / 2)
    assert s["codec_overdue_calls"] == 1 and s["codec_overdue_ms_p50"] == pytest.approx(1.0)
    assert s["late_launches"] == 0 and s["sync_steps"] == 0  # traces without those fields
    assert trace_summary([], 1.0) == {}


def test_late_prompt_launches_and_synchronous_steps_are_counted():
    """Servers since session 10 add each step's late prompt launches and its synchronous flag."""
    trace = [("step", 0.0, 0.004, 0.005, 8, 0.001, 0, 1, False), ("step", 0.005, 0.009, 0.01, 8, 0.001, 1, 0, True),
             ["step", 0.01, 0.014, 0.015, 8, 0.001, 0, 2, False]]
    s = trace_summary(trace, wall_s=0.05)
    assert s["late_launches"] == 3 and s["sync_steps"] == 1


def test_replay_device_time_beside_and_apart_from_codec_calls():
    trace = [("step", 0.0, 0.004, 0.005, 8, 0.0), ("codec", 0.010, 0.020, 2, 50, 1),
             ("replay", 0.001, 8, 0.005), ("replay", 0.012, 8, 0.009), ("replay", 0.030, 4, 0.004)]
    s = trace_summary(trace, wall_s=0.05)
    assert s["replay_ms_alone"] == pytest.approx(4.5) and s["replay_ms_beside_codec"] == pytest.approx(9.0)
    assert s["replay_rows_mean"] == pytest.approx(20 / 3)


def test_garbage_collections_are_counted_and_the_longest_found():
    trace = [("step", 0.0, 0.004, 0.005, 8, 0.0), ("gc", 0.010, 0.0102, 0), ("gc", 0.020, 0.320, 2),
             ["gc", 0.500, 0.525, 2]]  # a server's --trace-out file holds lists (JSON)
    s = trace_summary(trace, wall_s=1.0)
    assert (s["gc_collections"], s["gc_full"]) == (3, 2)
    assert s["gc_ms_max"] == pytest.approx(300.0) and s["gc_full_ms_max"] == pytest.approx(300.0)
    assert trace_summary(trace[:1], 1.0)["gc_collections"] == 0


def test_start_up_collections_are_kept_apart_from_serving_pauses():
    """The server marks the end of start-up (its own gc.collect() before gc.freeze() comes before)."""
    trace = [("gc", 0.0, 0.3, 2), ("serving", 0.5), ("step", 0.6, 0.604, 0.605, 8, 0.0), ("gc", 0.7, 0.71, 2)]
    s = trace_summary(trace, wall_s=1.0)
    assert (s["gc_collections"], s["gc_full"]) == (1, 1)
    assert s["gc_ms_max"] == pytest.approx(10.0) and s["gc_startup_ms_max"] == pytest.approx(300.0)


def test_kernels_built_while_serving_are_counted_with_their_time():
    trace = [("serving", 0.5), ("step", 0.6, 0.604, 0.605, 8, 0.0), ("build", 0.7, 0.74, "triton", "k[BLOCK=64]"),
             ["build", 0.8, 0.81, "dynamo", "0/1"]]
    s = trace_summary(trace, wall_s=1.0)
    assert s["builds"] == 2 and s["build_ms_sum"] == pytest.approx(50.0) and s["build_ms_max"] == pytest.approx(40.0)
    assert trace_summary(trace[:2], 1.0)["builds"] == 0


def test_ab_variants_change_one_setting_each():
    from types import SimpleNamespace

    from higgs_stream.bench import ab_variants

    args = SimpleNamespace(compare_codec_stream=True, compare_codec_sms="32,48", compare_gil_switch="5",
                           compare_codec_partition=True)
    assert ab_variants(args) == [{"codec_stream": "engine"}, {"codec_sms": 32}, {"codec_sms": 48},
                                 {"gil_switch_s": 0.005}, {"partition_steps": False}]
    none = SimpleNamespace(compare_codec_stream=False, compare_codec_sms="", compare_gil_switch="",
                           compare_codec_partition=False)
    assert ab_variants(none) == []


def test_another_arch_runs_the_decode_and_profile_sections_only(tmp_path, capsys):
    """`--arch qwen3-tts` (a random model drawn by the family) is refused for the sections that need
    the v2 reference or the Higgs codec, before anything is built."""
    from higgs_stream.bench import main

    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "b.json"), "--arch", "qwen3-tts", "--sections", "decode,stream"])
    assert exc.value.code == 2 and "decode and profile sections only" in capsys.readouterr().err


def test_kernel_groups_name_the_decode_steps_kernels():
    from higgs_stream.bench.decode import kernel_group

    assert kernel_group("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>") == "attention"
    assert kernel_group("rope_kv_store_kernel") == "rope/kv store"
    assert kernel_group("fused_add_rms_norm_kernel") == "norm"
    assert kernel_group("quantize_per_token_kernel") == "act quant"
    assert kernel_group("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_group("nvjet_tst_64x8_64x16_4x1_v_bz_TNN") == "gemm"
    assert kernel_group("sample_rows_kernel") == "sampling"
    assert kernel_group("silu_and_mul_kernel") == "activation"
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4, ...>") == "other"


def test_steps_are_grouped_by_the_largest_codec_call_beside_them():
    """steps_beside_calls: decode-only steps in the row range, by the largest overlapping call's frames."""
    from higgs_stream.bench import steps_beside_calls

    trace = [("codec", 0.010, 0.050, 64, 1600, 1), ("codec", 0.060, 0.062, 2, 50, 2),
             ("step", 0.000, 0.004, 0.005, 128, 0.001, 0),  # before any call
             ("step", 0.005, 0.044, 0.045, 128, 0.040, 0),  # beside the 1600-frame call (it starts in the step)
             ("step", 0.045, 0.054, 0.055, 128, 0.008, 0),  # the big call's tail
             ("step", 0.055, 0.063, 0.064, 120, 0.003, 0),  # beside the small one only
             ("step", 0.064, 0.069, 0.070, 128, 0.001, 3),  # prompt chunks: left out
             ("step", 0.070, 0.075, 0.076, 16, 0.001, 0)]  # outside the row range
    got = {g["beside"]: g for g in steps_beside_calls(trace, rows=(100, 140))}
    assert set(got) == {"none", "0-399 frames", ">=1200 frames"}
    assert got["none"]["steps"] == 1 and got["none"]["step_ms_p50"] == pytest.approx(5.0)
    assert got["0-399 frames"]["steps"] == 1 and got["0-399 frames"]["wait_ms_p95"] == pytest.approx(3.0)
    big = got[">=1200 frames"]
    assert big["steps"] == 2 and big["step_ms_p50"] == pytest.approx(25.0) and big["wait_ms_p50"] == pytest.approx(24.0)
    assert steps_beside_calls([], rows=(100, 140)) == []


def test_the_codec_backlog_after_each_call_is_summarized_when_the_trace_has_it():
    calls = [("codec", 0.0, 0.01, 2, 50, 1, False, h) for h in (0, 100, 40, 10)]
    s = trace_summary([("step", 0.0, 0.004, 0.005, 8, 0.001), *calls], wall_s=0.05)
    assert s["codec_held_frames_p50"] == pytest.approx(25.0) and s["codec_held_frames_max"] == 100
    older = trace_summary([("step", 0.0, 0.004, 0.005, 8, 0.001), ("codec", 0.0, 0.01, 2, 50, 1, False)], wall_s=0.05)
    assert "codec_held_frames_p95" not in older


def test_an_overdue_calls_wait_past_its_deadline_is_summarized_when_the_trace_has_it():
    """The 9th field: how late a call's most overdue job was when it began; only overdue calls count."""
    calls = [("codec", 0.0, 0.01, 1, 11, 1, True, 0, w) for w in (0.002, 0.010, 0.040)]
    calls.append(("codec", 0.02, 0.03, 4, 100, 2, False, 0, 0.0))  # nothing overdue: left out
    s = trace_summary([("step", 0.0, 0.004, 0.005, 8, 0.001), *calls], wall_s=0.05)
    assert s["codec_overdue_calls"] == 3
    assert s["codec_overdue_late_ms_p50"] == pytest.approx(10.0)
    assert s["codec_overdue_late_ms_max"] == pytest.approx(40.0)
    older = trace_summary([("step", 0.0, 0.004, 0.005, 8, 0.001), ("codec", 0.0, 0.01, 2, 50, 1, True, 5)], wall_s=0.05)
    assert older["codec_overdue_calls"] == 1 and "codec_overdue_late_ms_p50" not in older


def test_the_engines_waits_for_the_codec_queue_are_summarized_when_the_trace_has_them():
    """The step trace's 10th field: seconds the engine thread waited for room in the codec's queue."""
    steps = [("step", 0.0, 0.004, 0.005, 8, 0.001, 0, 0, False, w) for w in (0.0, 0.002, 0.030, 0.120)]
    s = trace_summary(steps, wall_s=1.0)
    assert s["queue_wait_s"] == pytest.approx(0.152) and s["queue_wait_ms_max"] == pytest.approx(120.0)
    assert s["queue_waits_over_5ms"] == 2
    assert "queue_wait_s" not in trace_summary([("step", 0.0, 0.004, 0.005, 8, 0.001)], wall_s=1.0)
