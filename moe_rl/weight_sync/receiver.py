"""The receiving side of a weight sync into a Megatron model (the Megatron engine, the mismatch
probe's reference model): buckets are decoded and loaded as they arrive, and the sync is complete
only when every tensor of the model has arrived exactly once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import Tensor

from moe_rl.weight_sync.buckets import Bucket
from moe_rl.weight_sync.wire import decode


def bucket_items(bucket: Bucket) -> list[tuple[str, Tensor, dict]]:
    """The ``(name, tensor, meta)`` a bucket carries (views into its buffer)."""
    return [(entry.name, tensor, entry.meta) for entry, tensor in bucket.tensors()]


def decoded(bucket: Bucket, device: torch.device | str | None = None) -> Iterable[tuple[str, Tensor]]:
    """A bucket's weights as the values the engine computes with (`wire.decode`), one at a time.
    With ``device`` what travelled is moved there first (FP8 bytes, not their float32 values) and
    decoded there."""
    items = bucket_items(bucket)
    if device is not None:
        items = [(name, tensor.to(device), meta) for name, tensor, meta in items]
    return decode(items)


class ModelReceiver:
    """Loads HF-named weights into a Megatron model part by part; `finish` checks completeness."""

    def __init__(self, model: torch.nn.Module):
        from moe_rl.megatron.hf_weights import hf_index

        self.model = model
        self.index = hf_index(model)
        self.pieces = Counter(self.index.values())
        """Megatron tensor -> how many HF tensors it is made of (fused QKV, gate/up: several)."""
        self.expected = set(self.index.values())
        self.loaded: set[str] = set()
        self.bytes = 0

    def begin(self) -> None:
        self.loaded, self.bytes = set(), 0

    def load(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Load each Megatron tensor as soon as all its HF pieces have come by in ``named`` (they
        travel together), so only one tensor's decoded values are held at a time."""
        from moe_rl.megatron.hf_weights import load_hf_subset

        pending: dict[str, dict[str, Tensor]] = {}
        for name, tensor in named:
            owner = self.index.get(name)
            if owner is None:  # not a tensor of this model: load_hf_subset names it (or ignores it)
                load_hf_subset(self.model, {name: tensor}, self.index)
                continue
            if owner in self.loaded:
                raise ValueError(f"weight {owner!r} arrived twice in one sync")
            group = pending.setdefault(owner, {})
            group[name] = tensor
            if len(group) == self.pieces[owner]:
                self.loaded |= load_hf_subset(self.model, pending.pop(owner), self.index)
                self.bytes += sum(t.numel() * t.element_size() for t in group.values())
        if pending:
            owner, group = next(iter(pending.items()))
            raise ValueError(
                f"Megatron tensor {owner!r} arrived without all its pieces (got {sorted(group)})"
            )

    def finish(self) -> None:
        """Raise unless every tensor of the model arrived in this sync."""
        missing = self.expected - self.loaded
        if missing:
            raise ValueError(
                f"weight sync incomplete: {len(missing)} of {len(self.expected)} tensors never arrived, "
                f"e.g. {sorted(missing)[:3]}"
            )
