"""Shared builders for the trajectory-format tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe_rl.data import Sample, TrajectoryBatch

VOCAB = 16
NUM_EXPERTS = 8


def _trace(length: int) -> torch.Tensor:
    """A routing trace ``[length, 2 layers, top-2]`` with distinct ids per (token, layer)."""
    t = torch.arange(length).reshape(-1, 1, 1)
    return torch.cat([torch.cat([t, t + 1], -1), torch.cat([t + 2, t + 3], -1)], 1) % NUM_EXPERTS


def _mask(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()], dtype=torch.int64)
    return torch.tensor([i for r in rows for i in r], dtype=torch.int32), offsets


def build_hand_batch() -> TrajectoryBatch:
    """Three samples: a full routing trace, a trace one token short, an empty response."""
    m0, m1, m2 = _mask([[4, 7], [5]]), _mask([[7], [1, 8], [9, 2, 3]]), _mask([])
    samples = [
        Sample(
            torch.tensor([1, 2, 3]),
            torch.tensor([4, 5]),
            torch.tensor([-0.1, -0.2]),
            1.0,
            0,
            "stop",
            [(0, 3)],
            m0[0],
            m0[1],
            _trace(5),
            torch.tensor([-0.15, -0.25]),
        ),
        Sample(
            torch.tensor([6]),
            torch.tensor([7, 8, 9]),
            torch.tensor([-1.0, -2.0, -0.5]),
            0.0,
            0,
            "length",
            [(0, 3), (2, 4)],
            m1[0],
            m1[1],
            _trace(3),
            torch.tensor([-1.1, -2.1, -0.6]),
        ),
        Sample(
            torch.tensor([10, 11]),
            torch.tensor([], dtype=torch.int32),
            torch.tensor([]),
            -1.0,
            1,
            "abort",
            [(0, 4)],
            m2[0],
            m2[1],
            _trace(2),
            torch.tensor([]),
        ),
    ]
    return TrajectoryBatch.from_samples(
        samples, engine="vllm", quant_recipe="fp8", policy_version=4, num_experts=NUM_EXPERTS
    )


@pytest.fixture
def hand_batch() -> TrajectoryBatch:
    return build_hand_batch()


@pytest.fixture
def make_hand_batch() -> Callable[[], TrajectoryBatch]:
    return build_hand_batch
