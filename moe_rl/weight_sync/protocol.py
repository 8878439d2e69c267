"""What a receiver of weight syncs is and what it is sent, without the machinery (no torch).

A sync reaches an engine process as messages of three kinds (`SyncMessage`), each its own type:

* a `moe_rl.weight_sync.buckets.Bucket` of tensors, which every `WeightReceiver` takes
  (``receive_bucket``): both rollout engines and the probe's reference model;
* a sender's `moe_rl.weight_sync.broadcast.BroadcastStream`, whose buckets the engine process
  takes in a thread of its own (`moe_rl.orchestration.engine_host.EngineHost.receive`);
* one of vLLM's weight-transfer calls (`TransferCall`: `TransferInit`, `TransferStart`,
  `TransferUpdate`, `TransferFinish`), which only a `TransferReceiver` (the vLLM engine on vLLM's
  transfer routes) takes; the bytes travel beside them, vLLM's worker to worker.

`SyncTarget` says which receiver of an engine process a sync fills.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:
    from moe_rl.weight_sync.broadcast import BroadcastStream
    from moe_rl.weight_sync.buckets import Bucket


class SyncTarget(StrEnum):
    """Which receiver of an engine process a sync fills: the engine, or the probe's reference model."""

    ENGINE = "engine"
    REFERENCE = "reference"


@dataclass(frozen=True)
class TransferInit:
    """vLLM's ``init_weight_transfer_engine``: join the sender's transfer (this engine's init info)."""

    init_info: dict[str, Any] = field(default_factory=dict)
    method: ClassVar[str] = "init_weight_transfer_engine"


@dataclass(frozen=True)
class TransferStart:
    """vLLM's ``start_weight_update``: a transfer of weights begins."""

    method: ClassVar[str] = "start_weight_update"


@dataclass(frozen=True)
class TransferUpdate:
    """vLLM's ``update_weights``: the weights ``update_info`` describes follow, worker to worker."""

    update_info: Any = None
    method: ClassVar[str] = "update_weights"


@dataclass(frozen=True)
class TransferFinish:
    """vLLM's ``finish_weight_update``: vLLM's part of the transfer ends (the engine takes the
    sync's version when the sync finishes, `WeightReceiver.finish_weight_update`)."""

    method: ClassVar[str] = "finish_weight_update"


TransferCall: TypeAlias = TransferInit | TransferStart | TransferUpdate | TransferFinish
"""One of vLLM's control-plane calls of a weight transfer, as an engine process is handed it
(``method``: vLLM's name of it)."""

SyncMessage: TypeAlias = "Bucket | BroadcastStream | TransferCall"
"""What a sender hands an engine process in a sync (see the module docstring)."""


@runtime_checkable
class WeightReceiver(Protocol):
    """Takes weight syncs: ``begin_weight_update(version)``, ``receive_bucket`` for each bucket,
    ``finish_weight_update(version)``, which checks the sync is complete, takes the version only then
    and returns what the receiver measured."""

    def begin_weight_update(self, version: int) -> None: ...

    def receive_bucket(self, bucket: Bucket) -> dict[str, float]: ...

    def finish_weight_update(self, version: int) -> dict[str, Any]: ...


@runtime_checkable
class TransferReceiver(WeightReceiver, Protocol):
    """A receiver that also takes vLLM's weight transfer (between ``begin_weight_update`` and
    ``finish_weight_update``, in place of buckets)."""

    def receive_transfer(self, call: TransferCall) -> None: ...
