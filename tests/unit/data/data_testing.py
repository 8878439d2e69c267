"""What the data tests share: a CSR sampling mask read back as Python lists."""

from __future__ import annotations

import itertools

from torch import Tensor


def csr_to_lists(ids: Tensor, offsets: Tensor) -> list[list[int]]:
    """CSR (``ids``, ``offsets``) -> one Python list of token ids per row, in stored order."""
    flat, bounds = ids.tolist(), offsets.tolist()
    return [flat[a:b] for a, b in itertools.pairwise(bounds)]
