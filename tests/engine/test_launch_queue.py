"""The launches in flight (engine/launch_queue.py), on the CPU: rows come back a step late, or at once in a
synchronous step; statuses become ends; late prompt launches are capped per regular launch and fail alone."""

from types import SimpleNamespace

import pytest
import torch

from higgs_stream.engine.gpu_sampling import ERROR, IGNORED, LENGTH, RUNNING, STOP
from higgs_stream.engine.launch_queue import HOST_ROWS, LATE_PER_STEP, LaunchQueue

K = 2


def seq(name: str, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(name=name, finished=finished)


def rows(*items: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor(items, dtype=torch.long)  # [S, K + 1]: K codes, then the status


def test_rows_come_back_one_launch_late_and_at_once_when_synchronous():
    q = LaunchQueue(torch.device("cpu"), max_batch=4, num_codebooks=K, launch_prompts=lambda chunks: None)
    a, b = seq("a"), seq("b")
    assert q.run(q.ship(rows((1, 2, RUNNING), (3, 4, STOP)), [a, b]), sync=False, late=None) == []
    assert len(q) == 1  # the first launch stays in flight while the host stages the next
    out = q.run(q.ship(rows((5, 6, LENGTH)), [a]), sync=False, late=None)
    assert [(o.seq.name, o.rows, o.end) for o in out] == [("a", [[1, 2]], None), ("b", [[3, 4]], "stop")]
    out = q.run(None, sync=True, late=None)  # nothing planned, synchronous: everything in flight
    assert [(o.seq.name, o.rows, o.end) for o in out] == [("a", [[5, 6]], "length")] and len(q) == 0
    assert q.run(None, sync=False, late=None) == [] and q.wait_s == 0.0  # no device events on the CPU


def test_errors_become_ends_and_ended_or_ignored_rows_are_skipped():
    q = LaunchQueue(torch.device("cpu"), max_batch=4, num_codebooks=K, launch_prompts=lambda chunks: None)
    done, ok, bad, ignored = seq("done", finished=True), seq("ok"), seq("bad"), seq("ignored")
    packed = rows((1, 1, RUNNING), (2, 2, RUNNING), (0, 0, ERROR), (3, 3, IGNORED))
    out = q.run(q.ship(packed, [done, ok, bad, ignored]), sync=True, late=None)
    assert [(o.seq.name, o.rows, o.end, o.error) for o in out] == [
        ("ok", [[2, 2]], None, None), ("bad", [], "error", "non-finite audio logits")]


def test_late_launches_are_capped_per_regular_launch_and_a_failed_one_fails_its_streams_alone():
    launched: list[list] = []

    def launch_prompts(chunks):
        if chunks[0].seq.name == "boom":
            raise RuntimeError("device fault")
        launched.append([c.seq.name for c in chunks])
        return q.ship(rows(*[(7, 7, RUNNING)] * len(chunks)), [c.seq for c in chunks])

    q = LaunchQueue(torch.device("cpu"), max_batch=4, num_codebooks=K, launch_prompts=launch_prompts)
    boom = seq("boom")  # two chunks of one stream: one error row
    arrivals = iter([[SimpleNamespace(seq=boom), SimpleNamespace(seq=boom)],
                     [SimpleNamespace(seq=seq("p"))], [SimpleNamespace(seq=seq("never"))]])
    q.run(q.ship(rows((1, 1, RUNNING)), [seq("s")]), sync=False, late=None)
    out = q.run(q.ship(rows((2, 2, RUNNING)), [seq("s")]), sync=False, late=lambda timeout: next(arrivals, []))
    assert LATE_PER_STEP == 2 and launched == [["p"]]  # the third arrival waits for the next regular launch
    assert [(o.seq.name, o.end) for o in out] == [("boom", "error"), ("s", None)]  # one error row per stream
    assert "device fault" in out[0].error and q.late_launches == 1 and len(q) == 2  # step 2 and p's launch
    out = q.run(None, sync=True, late=None)
    assert [(o.seq.name, o.rows) for o in out] == [("s", [[2, 2]]), ("p", [[7, 7]])]


def test_host_buffers_rotate():
    q = LaunchQueue(torch.device("cpu"), max_batch=2, num_codebooks=K, launch_prompts=lambda chunks: None)
    hosts = [q.ship(rows((i, i, RUNNING)), [seq(str(i))]).host for i in range(HOST_ROWS + 1)]
    assert hosts[0].data_ptr() == hosts[HOST_ROWS].data_ptr()  # the oldest buffer is reused after HOST_ROWS launches
    assert len({h.data_ptr() for h in hosts[:HOST_ROWS]}) == HOST_ROWS
    with pytest.raises(RuntimeError):  # a launch larger than max_batch rows does not fit a buffer
        q.ship(rows(*[(0, 0, RUNNING)] * 3), [seq("x")] * 3)
