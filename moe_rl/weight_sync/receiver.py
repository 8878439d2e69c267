"""The receiving side of a weight sync.

`WeightReceiver` is what every receiver implements — both rollout engines and the probe's
reference model: a sync begins with the policy version, buckets arrive one by one, and it finishes
with the version, which the receiver takes only then. `SyncTarget` names which receiver of an
engine process a sync fills. `ModelReceiver` is the receiving side into a Megatron model (the
Megatron engine, the reference model): buckets are decoded and loaded as they arrive, and the sync
is complete only when every tensor of the model has arrived exactly once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from moe_rl.weight_sync import ipc
from moe_rl.weight_sync.buckets import Bucket
from moe_rl.weight_sync.wire import Rejoin, decode


class SyncTarget(StrEnum):
    """Which receiver of an engine process a sync fills: the engine, or the mismatch probe's
    full-precision reference model next to it."""

    ENGINE = "engine"
    REFERENCE = "reference"


@runtime_checkable
class WeightReceiver(Protocol):
    """Takes weight syncs: ``begin_weight_update(version)``, ``receive_bucket(bucket)`` for each
    bucket, ``finish_weight_update(version)``, which checks the sync is complete, takes the
    version and returns what the receiver measured (numbers, the recipe's name)."""

    def begin_weight_update(self, version: int) -> None: ...

    def receive_bucket(self, bucket: Bucket) -> dict[str, float]: ...

    def finish_weight_update(self, version: int) -> dict[str, Any]: ...


def bucket_items(bucket: Bucket) -> list[tuple[str, Tensor, dict]]:
    """The ``(name, tensor, meta)`` a bucket carries (views into its buffer)."""
    return [(entry.name, tensor, entry.meta) for entry, tensor in bucket.tensors()]


def decoded(
    bucket: Bucket,
    device: torch.device | str | None = None,
    into: Callable[[str], Tensor | None] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    rejoin: Rejoin | None = None,
) -> Iterable[tuple[str, Tensor]]:
    """A bucket's weights as the values the engine computes with (`wire.decode`), one at a time.
    With ``device`` what travelled is moved there first (FP8 bytes, not their float32 values) and
    decoded there; ``into`` gives where a quantized weight's values may be decoded straight into
    (`ModelReceiver.place`), ``dtypes`` the dtype to decode the others to (`ModelReceiver.dtypes`).
    ``rejoin``: the receiver's `wire.Rejoin` for this sync, which puts tensors that travel in row
    chunks back together (a chunked tensor is yielded with its last chunk). A bucket read in its
    sender's device buffer (`Bucket.ipc`) waits, once the last weight has been taken, for the work
    queued on that device, so the sender does not overwrite the buffer while it is still read."""
    items = bucket_items(bucket)
    if device is not None:
        items = [(name, tensor.to(device), meta) for name, tensor, meta in items]
    yield from decode(items, into, dtypes, rejoin)
    if bucket.ipc is not None:
        ipc.ready(bucket.data.device)


class ModelReceiver:
    """Loads HF-named weights into a Megatron model part by part; `finish` checks completeness."""

    def __init__(self, model: torch.nn.Module):
        from moe_rl.megatron.hf_weights import hf_dtypes, hf_index

        self.model = model
        self.index = hf_index(model)
        self.dtypes = hf_dtypes(model)
        """HF name -> the dtype of the Megatron tensor it loads into (what a piece that cannot be
        decoded in place is decoded to: the values it will hold, in half the bytes of float32 for bf16)."""
        self.pieces = Counter(self.index.values())
        """Megatron tensor -> how many HF tensors it is made of (fused QKV, gate/up: several)."""
        self.expected = set(self.index.values())
        self.loaded: set[str] = set()
        self.bytes = 0
        self._views: dict[str, Tensor] = {}
        self.in_place: dict[str, Tensor] = {}
        """HF name -> the view of the model it was decoded into, this sync (`place`)."""
        self.rejoin = Rejoin()
        """Tensors that travel in row chunks, put back together over the buckets of a sync."""
        self._pending: dict[str, dict[str, Tensor]] = {}
        """Megatron tensor -> the HF pieces of it that arrived so far (a piece that travelled in
        chunks may complete in a later bucket than its siblings)."""

    def begin(self) -> None:
        from moe_rl.megatron.hf_weights import piece_views

        self.loaded, self.bytes = set(), 0
        self._views, self.in_place = piece_views(self.model), {}
        self.rejoin, self._pending = Rejoin(), {}

    def place(self, name: str) -> Tensor | None:
        """Where the values of HF tensor ``name`` may be decoded straight into: the view of the
        model's tensor it fills (`hf_weights.piece_views`), or None (it is then loaded by copy)."""
        view = self._views.get(name)
        if view is not None:
            self.in_place[name] = view
        return view

    def load(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """Load each Megatron tensor as soon as all its HF pieces have come by (they travel
        together, in one bucket, unless they are large enough to travel in row chunks), so only one
        tensor's decoded values are held at a time. A tensor still missing pieces at the end of
        the sync is an error of `finish`."""
        from moe_rl.megatron.hf_weights import load_hf_subset

        pending, arrived = self._pending, []
        for name, tensor in named:
            owner = self.index.get(name)
            if owner is None:  # not a tensor of this model: load_hf_subset names it (or ignores it)
                load_hf_subset(self.model, {name: tensor}, self.index)
                continue
            if owner in self.loaded:
                raise ValueError(f"weight {owner!r} arrived twice in one sync")
            group = pending.setdefault(owner, {})
            group[name] = tensor
            arrived.append((owner, name))
            if len(group) == self.pieces[owner]:
                if all(self.in_place.get(n) is t for n, t in group.items()):  # decoded in place
                    self.loaded.add(owner)
                else:
                    self.loaded |= load_hf_subset(self.model, group, self.index)
                del pending[owner]
                self.bytes += sum(t.numel() * t.element_size() for t in group.values())
        for owner, name in arrived:  # a piece waiting for a later bucket: its own copy, not a view of
            group = pending.get(owner)  # this bucket (the sender reuses the buffer)
            if group is not None and name in group and self._viewed(name, group[name]):
                group[name] = group[name].clone()

    def _viewed(self, name: str, tensor: Tensor) -> bool:
        """Whether ``tensor`` may be a view of a bucket: not the model's own view, not rejoined."""
        return self.in_place.get(name) is not tensor and not self.rejoin.owns(name, tensor)

    def finish(self) -> None:
        """Raise unless every tensor of the model arrived in this sync."""
        self.rejoin.finish()
        if self._pending:
            owner, group = next(iter(self._pending.items()))
            raise ValueError(
                f"Megatron tensor {owner!r} arrived without all its pieces (got {sorted(group)})"
            )
        missing = self.expected - self.loaded
        if missing:
            raise ValueError(
                f"weight sync incomplete: {len(missing)} of {len(self.expected)} tensors never arrived, "
                f"e.g. {sorted(missing)[:3]}"
            )
