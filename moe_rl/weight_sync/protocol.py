"""What a receiver of weight syncs is, without the machinery (no torch): `WeightReceiver`, which
every receiver implements (both rollout engines and the probe's reference model), and `SyncTarget`,
which receiver of an engine process a sync fills."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol, runtime_checkable


class SyncTarget(StrEnum):
    """Which receiver of an engine process a sync fills: the engine, or the probe's reference model."""

    ENGINE = "engine"
    REFERENCE = "reference"


@runtime_checkable
class WeightReceiver(Protocol):
    """Takes weight syncs: ``begin_weight_update(version)``, ``receive_bucket`` for each message of the
    route (a bucket, a stream, a vLLM transfer call), ``finish_weight_update(version)``, which checks
    the sync is complete, takes the version only then and returns what the receiver measured."""

    def begin_weight_update(self, version: int) -> None: ...

    def receive_bucket(self, bucket: Any) -> dict[str, float]: ...

    def finish_weight_update(self, version: int) -> dict[str, Any]: ...
