"""Ragged arrays as ``(values, offsets)``: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``.

``offsets`` is int64 with ``num_rows + 1`` entries, starts at 0 and ends at ``len(values)``.
``values`` may have trailing dimensions (a routing trace is ragged over tokens with rows of shape
``[layers, k]``). Every helper here is vectorized: no Python loop over rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def lengths(offsets: Tensor) -> Tensor:
    """Row lengths, int64 ``[num_rows]``."""
    return offsets[1:] - offsets[:-1]


def offsets_from_lengths(row_lengths: Tensor) -> Tensor:
    """Offsets (int64, leading 0) for the given row lengths."""
    out = torch.zeros(row_lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(row_lengths.to(torch.int64), dim=0, out=out[1:])
    return out


def repeat(values: Tensor, counts: Tensor) -> Tensor:
    """``values[i]`` repeated ``counts[i]`` times (``torch.repeat_interleave``, through numpy,
    which is an order of magnitude faster on CPU)."""
    return torch.from_numpy(np.repeat(values.numpy(), counts.numpy()))


def row_ids(offsets: Tensor) -> Tensor:
    """For every value, the index of the row it belongs to (int64 ``[num_values]``)."""
    num_rows = offsets.numel() - 1
    return repeat(torch.arange(num_rows, dtype=torch.int64), lengths(offsets))


def row_sums(values: Tensor, offsets: Tensor) -> Tensor:
    """Sum of each row of a 1-D ``values`` (``[num_rows]``, the dtype of ``values``; 0 for an empty row)."""
    cumulative = torch.zeros(values.numel() + 1, dtype=values.dtype)
    torch.cumsum(values, dim=0, out=cumulative[1:])
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


def locate(offsets: Tensor, flat_index: int) -> tuple[int, int]:
    """``(row, index within row)`` of the value at ``flat_index``."""
    row = int(torch.searchsorted(offsets, torch.tensor([flat_index]), right=True)[0]) - 1
    return row, flat_index - int(offsets[row])


def gather_positions(offsets: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """Flat positions of rows ``indices`` (in that order) and the offsets of the gathered rows."""
    indices = indices.to(torch.int64)
    sel_lengths = lengths(offsets)[indices]
    new_offsets = offsets_from_lengths(sel_lengths)
    total = int(new_offsets[-1])
    starts = repeat(offsets[:-1][indices], sel_lengths)
    base = repeat(new_offsets[:-1], sel_lengths)
    return starts + torch.arange(total, dtype=torch.int64) - base, new_offsets


def gather(values: Tensor, offsets: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Rows ``indices`` of a ragged array: ``(values, offsets, source positions)``."""
    positions, new_offsets = gather_positions(offsets, indices)
    return values[positions], new_offsets, positions


def concat(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Concatenate ragged arrays row-wise."""
    values = torch.cat([v for v, _ in parts])
    new_offsets = offsets_from_lengths(torch.cat([lengths(o) for _, o in parts]))
    return values, new_offsets
