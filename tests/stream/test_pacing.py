"""Deadline-aware scheduling in plain Python: playback clocks, pause/resume with hysteresis,
the loop-time model behind admission, and the pipeline refusing a stream when saturated."""

from __future__ import annotations

import math

import pytest

from higgs_stream.engine.errors import ConfigError
from higgs_stream.stream.pacing import LoopModel, Pacer, PacingConfig, PlaybackClock, relaxed


def test_playback_clock_counts_audio_left_at_the_listener():
    c = PlaybackClock()
    assert c.ahead_s(5.0) == -math.inf and c.deadline(5.0) == 5.0  # waiting for its first audio: most urgent
    c.sent(10.0, 1.0)  # first audio at t=10
    c.sent(10.2, 2.0)
    assert c.ahead_s(10.5) == pytest.approx(2.5)  # 3 s sent, 0.5 s played
    assert c.deadline(11.0) == pytest.approx(13.0)  # runs dry at 10 + 3
    assert c.ahead_s(14.0) == pytest.approx(-1.0)  # starving for a second


def clocks(**ahead):
    """Clocks whose listeners have `ahead` seconds left at t = 100."""
    out = {}
    for i, a in enumerate(ahead.values()):
        c = PlaybackClock()
        c.sent(90.0, 10.0 + a)
        out[i] = c
    return out


def test_pacer_pauses_far_ahead_streams_only_while_saturated_with_hysteresis():
    cfg = PacingConfig(pause_ahead_s=3.0, resume_ahead_s=2.0, saturated_ratio=0.25)
    pacer = Pacer(cfg)
    cs = clocks(a=5.0, b=2.5, c=0.1)
    assert pacer.plan(100.0, cs, loop_s=0.005) == ([], [], None)  # 5 ms < 10 ms: not saturated, nobody paused
    pause, resume, wake = pacer.plan(100.0, cs, loop_s=0.02)
    assert pause == [0] and resume == [] and wake == pytest.approx(3.0)  # resume when 2 s are left
    assert pacer.plan(100.5, cs, loop_s=0.02) == ([], [], pytest.approx(2.5))  # still 4.5 s ahead: stays paused
    assert pacer.plan(102.9, cs, loop_s=0.02)[:2] == ([], [])  # 2.1 s ahead: above the resume mark
    assert pacer.plan(103.0, cs, loop_s=0.02)[:2] == ([], [0])  # 2.0 s: resumed
    assert pacer.plan(103.0, cs, loop_s=0.02)[:2] == ([], [])  # 2 s < 3 s: not paused again (hysteresis)
    pacer.plan(100.0, cs, loop_s=0.02)
    assert pacer.paused == {0}
    assert pacer.plan(100.0, cs, loop_s=0.001)[:2] == ([], [0])  # load gone: everyone runs
    assert pacer.paused == set()


def test_pacer_never_leaves_the_talker_idle():
    """Pausing frees steps for streams that need them: with every stream far ahead nobody is paused,
    and once the talker has nothing but paused streams to run (`idle`), everyone resumes at once,
    whatever the last loop time was (no step ran since: it is stale)."""
    cfg = PacingConfig(pause_ahead_s=3.0, resume_ahead_s=2.0, saturated_ratio=0.25)
    pacer = Pacer(cfg)
    assert pacer.plan(100.0, clocks(a=5.0, b=4.0), loop_s=0.02) == ([], [], None)  # nobody needs the steps
    cs = clocks(a=5.0, b=4.0, c=1.0)
    assert pacer.plan(100.0, cs, loop_s=0.02)[:2] == ([0, 1], [])  # c needs them
    assert pacer.plan(100.1, cs, loop_s=0.02, idle=True)[:2] == ([], [0, 1])  # c ended: the talker idles
    assert pacer.paused == set()
    waiting = clocks(a=5.0)
    waiting[1] = PlaybackClock()  # no audio yet: it waits for its first chunk
    assert pacer.plan(100.0, waiting, loop_s=0.02)[:2] == ([0], [])


def test_held_streams_stay_paused_at_any_load_until_released():
    """A stream held for its client (StreamHandle._hold) is paused whether or not the GPU is saturated, is not
    resumed when the talker idles, does not count as needing steps, and follows the load again once released."""
    cfg = PacingConfig(pause_ahead_s=3.0, resume_ahead_s=2.0, saturated_ratio=0.25)
    pacer = Pacer(cfg)
    cs = clocks(a=0.5, b=5.0)
    assert pacer.plan(100.0, cs, loop_s=0.001, held={0}) == ([0], [], None)  # not saturated: paused all the same
    assert pacer.plan(100.1, cs, loop_s=0.001, idle=True, held={0}) == ([], [], None)  # idle: held stays paused
    assert pacer.plan(100.2, cs, loop_s=0.02, held={0})[:2] == ([], [])  # b far ahead, a held: nobody needs steps
    assert pacer.plan(100.3, cs, loop_s=0.001)[:2] == ([], [0])  # released
    assert pacer.paused == set()


def test_streams_far_ahead_yield_to_a_newcomer_until_its_first_audio():
    """While a stream waits for its first audio, streams more than yield_ahead_s ahead skip steps even
    when the GPU is not saturated; once it has audio they resume (not saturated), or stay paused down to
    the resume mark (saturated). yield_ahead_s=None: no yielding."""
    cfg = PacingConfig(pause_ahead_s=3.0, resume_ahead_s=2.0, saturated_ratio=0.25, yield_ahead_s=1.0)
    pacer = Pacer(cfg)
    cs = clocks(a=5.0, b=1.5, c=0.5)
    cs[3] = PlaybackClock()  # the newcomer: no audio yet
    pause, resume, wake = pacer.plan(100.0, cs, loop_s=0.005)  # not saturated
    assert pause == [0, 1] and resume == [] and wake == pytest.approx(0.5)  # b is 0.5 s above the yield mark
    assert pacer.plan(100.01, cs, loop_s=0.005)[:2] == ([], [])  # still waiting: they stay paused
    cs[3].sent(100.02, 0.08)  # the newcomer's first audio
    assert pacer.plan(100.02, cs, loop_s=0.005)[:2] == ([], [0, 1])  # not saturated: both run again
    saturated = Pacer(cfg)
    waiting = {**cs, 3: PlaybackClock()}
    assert saturated.plan(100.0, waiting, loop_s=0.02)[:2] == ([0, 1], [])
    waiting[3].sent(100.02, 0.08)
    assert saturated.plan(100.02, waiting, loop_s=0.02)[:2] == ([], [1])  # a (4.98 s) stays paused: above 2 s; b (1.48 s) runs
    off = Pacer(PacingConfig(pause_ahead_s=3.0, resume_ahead_s=2.0, saturated_ratio=0.25, yield_ahead_s=None))
    newcomer = {**clocks(a=5.0, b=2.5), 2: PlaybackClock()}
    assert off.plan(100.0, newcomer, loop_s=0.005) == ([], [], None)
    # under load (more than yield_max_streams others) nobody yields: streams keep running ahead
    capped = Pacer(PacingConfig(pause_ahead_s=3.0, resume_ahead_s=2.0, saturated_ratio=0.25, yield_max_streams=2))
    crowd = {**clocks(a=5.0, b=2.5, c=1.5), 3: PlaybackClock()}
    assert capped.plan(100.0, crowd, loop_s=0.005) == ([], [], None)
    assert capped.plan(100.0, {**clocks(a=5.0, b=2.5), 2: PlaybackClock()}, loop_s=0.005)[:2] == ([0, 1], [])


def test_relaxed_only_at_low_load_with_every_stream_far_ahead():
    cfg = PacingConfig(yield_ahead_s=1.0, yield_max_streams=2)
    assert relaxed(100.0, clocks(a=3.0, b=1.5), cfg)
    assert not relaxed(100.0, clocks(a=3.0, b=0.5), cfg)  # b is close to its listener
    assert not relaxed(100.0, {**clocks(a=3.0), 1: PlaybackClock()}, cfg)  # a newcomer waits
    assert not relaxed(100.0, clocks(a=3.0, b=2.0, c=2.0), cfg)  # more than yield_max_streams: load
    assert not relaxed(100.0, {}, cfg)
    assert not relaxed(100.0, clocks(a=3.0), PacingConfig(yield_ahead_s=None))


def test_an_idle_server_always_admits():
    """One slow step (first-use kernel compilation: seconds) predicts a saturated engine; with no stream
    running nothing would ever update the model, so an idle server admits anyway."""
    model, cfg = LoopModel(), PacingConfig(admit_ratio=0.5)
    model.observe(1, 22.0)
    assert model.admits(0, cfg) and not model.admits(1, cfg)


def test_loop_model_predicts_from_a_linear_fit_and_admits_below_the_ratio():
    model, cfg = LoopModel(decay=0.05), PacingConfig(admit_ratio=0.5)  # admit while a step <= 20 ms
    assert model.predict(10) is None and model.admits(10, cfg)  # no data yet: admit
    for _ in range(200):
        for rows in (8, 16, 32, 64):
            model.observe(rows, 0.004 + 0.0002 * rows)  # 4 ms + 0.2 ms per stream
    assert model.predict(32) == pytest.approx(0.0104, rel=1e-3)
    assert model.predict(128) == pytest.approx(0.0296, rel=3e-3)  # extrapolated (the ridge: slope x 0.998)
    assert model.admits(78, cfg) and not model.admits(80, cfg)  # 79 -> 19.8 ms, 81 -> 20.2 ms
    flat = LoopModel()
    for _ in range(50):
        flat.observe(4, 0.003)
    assert flat.predict(400) == pytest.approx(0.003)  # one batch size seen: no slope invented


def test_row_less_iterations_count_toward_the_next_step_with_rows():
    """A late prompt launch's iteration returns no row: its time joins the next iteration with rows (one decode
    cycle), capped; an idle engine drops what was carried."""
    m = LoopModel()
    for _ in range(50):  # v3's burst: 25 ms without rows, then 1 ms with 70
        m.observe_iteration(0, 0.025, cap_s=0.08)
        m.observe_iteration(70, 0.001, cap_s=0.08)
    assert m.predict(70) == pytest.approx(0.026) and m.last_s == pytest.approx(0.026)
    m.observe_iteration(0, 0.5, cap_s=0.08)
    m.observe_iteration(70, 0.001, cap_s=0.08)
    assert m.last_s == pytest.approx(0.026 + 0.2 * (0.08 - 0.026))  # capped at 80 ms
    m.observe_iteration(0, 0.3, cap_s=0.08)
    m.idle()
    m.observe_iteration(70, 0.026, cap_s=0.08)
    assert m.last_s == pytest.approx(0.026 + 0.2 * (0.08 - 0.026) + 0.2 * (0.026 - (0.026 + 0.2 * (0.08 - 0.026))))


def test_a_slope_needs_rows_that_vary():
    """Paced streams ran one row a step (9 ms) for hundreds of steps; a few two-row steps took 18 ms. A
    plain fit slopes ~9 ms a row and predicts ~54 ms at six streams (refusing them); the ridge on the
    rows' variance keeps that near the measured 9 ms, and a fit over rows that do vary keeps its slope."""
    m = LoopModel()
    for i in range(300):
        m.observe(2 if i in (150, 290) else 1, 0.018 if i in (150, 290) else 0.009)
    assert m.predict(6) < 0.012 and m.admits(5, PacingConfig(frame_s=0.08))
    wide = LoopModel()
    for i in range(300):
        rows = 1 + i % 128
        wide.observe(rows, 0.004 + 0.00005 * rows)
    assert wide.predict(200) == pytest.approx(0.004 + 0.00005 * 200, rel=0.02)


def test_admission_by_load_can_be_off():
    model = LoopModel()
    model.observe(8, 1.0)  # a second per step: far beyond any ratio
    assert not model.admits(8, PacingConfig(admit_ratio=0.5))
    assert model.admits(8, PacingConfig(admit_ratio=None))


def test_pacing_config_validation_of_yield():
    with pytest.raises(ConfigError, match="yield_ahead_s"):
        PacingConfig(yield_ahead_s=-0.1)
    with pytest.raises(ConfigError, match="yield_max_streams"):
        PacingConfig(yield_max_streams=0)
    assert PacingConfig(yield_ahead_s=0.0).yield_ahead_s == 0.0


def test_pacing_config_validation():
    for bad in ({"frame_s": 0}, {"pause_ahead_s": 1.0, "resume_ahead_s": 1.0}, {"saturated_ratio": 0},
                {"admit_ratio": 1.5}):
        with pytest.raises(ConfigError):
            PacingConfig(**bad)
