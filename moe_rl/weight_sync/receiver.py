"""The receiving side of a weight sync into a Megatron model (the Megatron engine, the mismatch
probe's reference model): buckets are decoded and loaded as they arrive, and the sync is complete
only when every tensor of the model has arrived exactly once."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from moe_rl.weight_sync.buckets import Bucket
from moe_rl.weight_sync.wire import decode


def bucket_items(bucket: Bucket) -> list[tuple[str, Tensor, dict]]:
    """The ``(name, tensor, meta)`` a bucket carries (views into its buffer)."""
    return [(entry.name, tensor, entry.meta) for entry, tensor in bucket.tensors()]


def decoded(bucket: Bucket) -> Iterable[tuple[str, Tensor]]:
    """A bucket's weights as the values the engine computes with (`wire.decode`)."""
    return decode(bucket_items(bucket))


class ModelReceiver:
    """Loads HF-named weights into a Megatron model part by part; `finish` checks completeness."""

    def __init__(self, model: torch.nn.Module):
        from moe_rl.megatron.hf_weights import hf_index

        self.model = model
        self.index = hf_index(model)
        self.expected = set(self.index.values())
        self.loaded: set[str] = set()
        self.bytes = 0

    def begin(self) -> None:
        self.loaded, self.bytes = set(), 0

    def load(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Load whole Megatron tensors (all their HF pieces are in ``named``)."""
        from moe_rl.megatron.hf_weights import load_hf_subset

        weights = dict(named)
        again = {self.index[n] for n in weights if n in self.index} & self.loaded
        if again:
            raise ValueError(f"weights {sorted(again)[:3]} arrived twice in one sync")
        self.loaded |= load_hf_subset(self.model, weights, self.index)
        self.bytes += sum(t.numel() * t.element_size() for t in weights.values())

    def finish(self) -> None:
        """Raise unless every tensor of the model arrived in this sync."""
        missing = self.expected - self.loaded
        if missing:
            raise ValueError(
                f"weight sync incomplete: {len(missing)} of {len(self.expected)} tensors never arrived, "
                f"e.g. {sorted(missing)[:3]}"
            )
