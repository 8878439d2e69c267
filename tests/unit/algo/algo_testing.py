"""Small builders shared by the `moe_rl.algo` unit tests."""

from __future__ import annotations

import torch
from torch import Tensor


def seq_ids_for(lengths: list[int]) -> Tensor:
    """Packed sequence index: lengths [2, 3] → [0, 0, 1, 1, 1]."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def t(values, dtype=torch.float64, requires_grad: bool = False) -> Tensor:
    return torch.tensor(values, dtype=dtype, requires_grad=requires_grad)


def all_true(n: int) -> Tensor:
    return torch.ones(n, dtype=torch.bool)


def grad_of(loss: Tensor, x: Tensor) -> Tensor:
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g
