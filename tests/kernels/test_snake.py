"""The plain-torch Snake definition (CPU); the Triton kernel is compared with it in test_snake_gpu.py."""

import math

import torch

from higgs_stream.kernels.snake import snake_ref


def test_snake_ref_hand_values():
    x = torch.tensor([[[1.0, -2.0, 0.0]], [[0.5, 3.0, -1.0]]])  # [B=2, C=1, T=3]
    alpha = torch.tensor([[[0.5]]])
    got = snake_ref(x, alpha)
    want = [[v + math.sin(0.5 * v) ** 2 / (0.5 + 1e-9) for v in row[0]] for row in x.tolist()]
    assert torch.allclose(got[:, 0, :], torch.tensor(want), atol=1e-6)
    assert got[0, 0, 2] == 0.0  # snake(0) = 0


def test_snake_beta_ref_hand_values():
    """SnakeBeta with log parameters: x + sin²(x e^a) / (e^b + 1e-9)."""
    from higgs_stream.kernels.snake import snake_beta_ref

    x = torch.tensor([[[1.0, -2.0], [0.25, 3.0]]])  # [B=1, C=2, T=2]
    la, lb = torch.tensor([0.0, math.log(2.0)]), torch.tensor([math.log(0.5), 0.0])
    got = snake_beta_ref(x, la, lb)
    want = [[v + math.sin(v * 1.0) ** 2 / (0.5 + 1e-9) for v in (1.0, -2.0)],
            [v + math.sin(v * 2.0) ** 2 / (1.0 + 1e-9) for v in (0.25, 3.0)]]
    assert torch.allclose(got[0], torch.tensor(want), atol=1e-6)
