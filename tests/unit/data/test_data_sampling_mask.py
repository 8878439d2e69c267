"""CSR sampling-mask helpers."""

from __future__ import annotations

import pytest
import torch

from moe_rl.data import TrajectoryError
from moe_rl.data.sampling_mask import csr_contains, csr_duplicate_rows, csr_from_lists
from tests.unit.data.data_testing import csr_to_lists

ROWS = [[5, 1, 3], [2], [0, 4], [3]]


def test_from_lists_keeps_order_and_round_trips() -> None:
    ids, offsets = csr_from_lists(ROWS)
    assert ids.dtype == torch.int32 and offsets.dtype == torch.int64
    assert offsets.tolist() == [0, 3, 4, 6, 7]
    assert csr_to_lists(ids, offsets) == ROWS


def test_contains_is_per_row() -> None:
    ids, offsets = csr_from_lists(ROWS)
    query = torch.tensor([3, 3, 4, 0])
    assert csr_contains(ids, offsets, query).tolist() == [True, False, True, False]


def test_contains_on_empty_rows_is_false() -> None:
    ids, offsets = csr_from_lists([[], [1]])
    assert csr_contains(ids, offsets, torch.tensor([1, 1])).tolist() == [False, True]


def test_duplicate_rows() -> None:
    ids, offsets = csr_from_lists([[1, 2, 1], [1, 2], [7, 7], [3]])
    assert csr_duplicate_rows(ids, offsets).tolist() == [True, False, True, False]
    assert csr_duplicate_rows(*csr_from_lists([[4]])).tolist() == [False]


def test_negative_ids_are_rejected_with_the_row() -> None:
    with pytest.raises(TrajectoryError, match=r"sampling_mask_ids \(token 1\)"):
        csr_from_lists([[1], [2, -4]])
