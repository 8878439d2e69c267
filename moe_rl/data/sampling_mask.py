"""Sampling masks (keep-sampling-mask, KSM) as CSR: ``ids`` int32 + ``offsets`` int64.

Row ``t`` (one per response token) is the set of vocabulary ids the engine kept after top-k /
top-p / min-p filtering when it sampled token ``t``: ``ids[offsets[t]:offsets[t + 1]]``. The
memory cost is O(sum of kept-set sizes), never O(tokens x vocab). The order of ids inside a row
is kept as the engine gave it. All checks here are vectorized over rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from moe_rl.data import ragged
from moe_rl.data.errors import TrajectoryError

_INT32_MAX = (1 << 31) - 1


def csr_from_lists(rows: Sequence[Iterable[int]]) -> tuple[Tensor, Tensor]:
    """Kept sets (one iterable of token ids per response token, order kept) -> ``(ids int32,
    offsets int64)``."""
    rows = [list(r) for r in rows]
    row_lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    offsets = ragged.offsets_from_lengths(row_lengths)
    flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(offsets[-1]))
    if flat.size and (flat.min() < 0 or flat.max() > _INT32_MAX):
        bad = int(flat.min()) if flat.min() < 0 else int(flat.max())
        row, _ = ragged.locate(offsets, int(np.argmax(flat == bad)))
        raise TrajectoryError(
            "sampling_mask_ids", "token id out of range", token=row, value=bad, expected=f"0..{_INT32_MAX}"
        )
    return torch.from_numpy(flat.astype(np.int32)), offsets


def csr_contains(ids: Tensor, offsets: Tensor, query: Tensor) -> Tensor:
    """``result[t]`` is True iff ``query[t]`` is in row ``t``; bool ``[rows]``."""
    rows = ragged.row_ids(offsets)
    hits = ids.to(torch.int64) == query.to(torch.int64)[rows]
    found = torch.zeros(offsets.numel() - 1, dtype=torch.int64)
    found.index_add_(0, rows, hits.to(torch.int64))
    return found > 0


def csr_duplicate_rows(ids: Tensor, offsets: Tensor) -> Tensor:
    """``result[t]`` is True iff row ``t`` lists some id twice; bool ``[rows]``."""
    num_rows = offsets.numel() - 1
    dup = torch.zeros(num_rows, dtype=torch.bool)
    if ids.numel() < 2:
        return dup
    shifted = ids.numpy().astype(np.int64) - int(ids.min())
    span = int(shifted.max()) + 1
    keys = np.sort(
        ragged.row_ids(offsets).numpy() * span + shifted
    )  # numpy: far faster than torch.sort on CPU
    same = keys[1:] == keys[:-1]
    dup[torch.from_numpy(keys[1:][same] // span)] = True
    return dup
