"""logits_at_rows: the head runs on the rows a step wants, NaN at the others."""

import torch
from higgs_stream.engine.batch import logits_at_rows


def test_logits_at_rows_runs_the_head_on_wanted_rows_only():
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 6, bias=False)
    last = torch.randn(3, 4)
    seen: list[int] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return head(x)

    full = logits_at_rows(counted, last, torch.tensor([True, True, True]), (2, 3))
    assert full.shape == (3, 2, 3) and full.dtype == torch.float32 and seen == [3]
    torch.testing.assert_close(full, head(last).view(3, 2, 3), rtol=0, atol=0)

    some = logits_at_rows(counted, last, torch.tensor([False, True, False]), (2, 3))
    assert seen == [3, 1] and some[[0, 2]].isnan().all()
    torch.testing.assert_close(some[1], head(last[1:2]).view(2, 3), rtol=0, atol=0)  # the same matmul shape

    none = logits_at_rows(counted, last, torch.tensor([False, False, False]), (6,))
    assert seen == [3, 1] and none.shape == (3, 6) and none.isnan().all()
