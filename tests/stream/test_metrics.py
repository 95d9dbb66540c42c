"""Prometheus text output and the underrun meter."""

from __future__ import annotations

import threading

import pytest
from higgs_stream.stream.metrics import Counter, Histogram, Metrics, UnderrunMeter


def test_exposition_format():
    m = Metrics()
    m.active_streams.set(3)
    m.requests.inc(transport="ws", outcome="completed")
    m.requests.inc(2, transport="http", outcome="error")
    m.ttfa.observe(0.12)
    m.ttfa.observe(0.4)
    m.ttfa.observe(30.0)
    text = m.render()
    lines = text.splitlines()
    assert "# TYPE higgs_active_streams gauge" in lines and "higgs_active_streams 3" in lines
    assert "# TYPE higgs_requests_total counter" in lines
    assert 'higgs_requests_total{transport="http",outcome="error"} 2' in lines
    assert 'higgs_requests_total{transport="ws",outcome="completed"} 1' in lines
    assert 'higgs_ttfa_seconds_bucket{le="0.1"} 0' in lines
    assert 'higgs_ttfa_seconds_bucket{le="0.15"} 1' in lines
    assert 'higgs_ttfa_seconds_bucket{le="0.5"} 2' in lines
    assert 'higgs_ttfa_seconds_bucket{le="10"} 2' in lines
    assert 'higgs_ttfa_seconds_bucket{le="+Inf"} 3' in lines
    assert "higgs_ttfa_seconds_count 3" in lines
    assert "higgs_ttfa_seconds_sum 30.52" in lines
    assert "higgs_underruns_total 0" in lines
    assert text.endswith("\n")
    for line in lines:  # every sample line is `name{labels} value`
        if not line.startswith("#"):
            _, value = line.rsplit(" ", 1)
            float(value.replace("+Inf", "inf"))


def test_label_escaping_and_checks():
    c = Counter("x_total", "help", ("code",))
    c.inc(code='a"b\\c\nd')
    assert c.render() == ['x_total{code="a\\"b\\\\c\\nd"} 1']
    with pytest.raises(AssertionError):
        c.inc(other="1")
    with pytest.raises(AssertionError):
        c.inc(-1, code="x")


def test_histogram_threadsafe():
    h = Histogram("h", "help", (1.0,))
    threads = [threading.Thread(target=lambda: [h.observe(0.5) for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert h.count == 4000 and h.render()[0] == 'h_bucket{le="1"} 4000'


def test_underrun_meter():
    m = UnderrunMeter(sample_rate=100)
    assert not m.chunk(0.0, 10)  # 0.1 s delivered at t=0
    assert not m.chunk(0.05, 20)  # arrives while 0.05 s still queued
    assert not m.chunk(0.3, 10)  # 0.3 s played exactly by now: not late
    assert m.chunk(0.5, 10)  # 0.4 s delivered by 0.3 -> ran dry at 0.4
    assert m.underruns == 1 and m.max_gap_s == pytest.approx(0.25)
    # the listener resumed at 0.5 with 0.1 s: the next chunk at 0.55 is in time
    assert not m.chunk(0.55, 10)


def test_the_readme_lists_every_metric_with_its_kind():
    """Operators read the metrics from the README's table: every metric /metrics exports is in it."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("### Metrics (`GET /metrics`"):]
    for m in Metrics().all():
        assert f"| `{m.name}` | {m.kind} |" in table, f"README's metrics table lacks {m.name}"
