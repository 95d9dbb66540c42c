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
