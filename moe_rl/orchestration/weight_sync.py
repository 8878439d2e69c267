"""The weight-sync coordinator: it runs a sync from the trainer to the engines, which do not know
each other.

A sync of policy ``version`` into a `moe_rl.weight_sync.receiver.SyncTarget` of some replicas:
the engine pool tells them it begins (`begin`), the trainer streams its buckets to them (each rank
its own tensors, `moe_rl.weight_sync.sender.RankSender`), the pool has each take the version when
its last bucket has landed (`finish`), and the coordinator returns one `SyncReport`, whose
`SyncReport.metrics` are the run's ``sync/*`` and ``quant/*`` metrics. A replica the pool restarts
is brought to the current weights through the coordinator (`EnginePool.on_restart`). The
coordinator holds the policy version the engines hold (`version`): the one place the driver reads it.

It works against two small interfaces, so the Ray run and the one-process loop share it: a
trainer that streams weights (``stream_weights(actors, quantized_wire, target) -> SyncReport``) and
an engine pool (``replicas``, ``quantized_wire``, ``begin``, ``finish``, ``on_restart`` and each
replica's ``actor``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from moe_rl.weight_sync.receiver import SyncTarget
from moe_rl.weight_sync.report import SyncReport


class WeightSender(Protocol):
    """The trainer side of a sync: every rank streams what it owns to the given receivers."""

    def stream_weights(
        self, engines: Sequence[Any], quantized_wire: bool, target: SyncTarget
    ) -> SyncReport: ...


class WeightReceivers(Protocol):
    """The engine side of a sync: replicas that begin, receive (through their ``actor``) and finish."""

    replicas: list
    quantized_wire: bool
    on_restart: Any
    on_cut_off: Any

    def begin(self, version: int, replicas: list, target: SyncTarget) -> list: ...

    def finish(self, version: int, replicas: list, dead: set[int], target: SyncTarget) -> dict: ...


class WeightSync:
    """Runs syncs from ``trainer`` to ``engines`` (see the module docstring)."""

    def __init__(self, trainer: WeightSender, engines: WeightReceivers, version: int = 0):
        self.trainer, self.engines = trainer, engines
        self.version = version
        """The policy version the engines hold."""
        self._in_progress: int | None = None
        engines.on_restart = self._bring_up
        engines.on_cut_off = self._sync_again

    def run(
        self, version: int, target: SyncTarget = SyncTarget.ENGINE, replicas: list | None = None
    ) -> SyncReport:
        """Sync ``version`` into ``target`` of ``replicas`` (default: every replica); a sync of the
        engines' weights of every replica makes ``version`` the current one."""
        start = time.perf_counter()
        report = self._sync(self.engines.replicas if replicas is None else replicas, version, target)
        if target == SyncTarget.ENGINE and replicas is None:
            self.version = version
        report.seconds = time.perf_counter() - start
        return report

    def _sync(self, replicas: list, version: int, target: SyncTarget) -> SyncReport:
        outer, self._in_progress = self._in_progress, version
        try:
            begun = self.engines.begin(version, replicas, target)
            if not begun:
                return SyncReport(version)
            quantized = (
                self.engines.quantized_wire and target == SyncTarget.ENGINE
            )  # the probe's: full precision
            report = self.trainer.stream_weights([r.actor for r in begun], quantized, target)
            report.version = version
            dead = {begun[i].index for i in report.dead}
            report.received = self.engines.finish(version, begun, dead, target)
            return report
        finally:
            self._in_progress = outer

    def _sync_again(self, replicas: list, version: int, target: SyncTarget) -> None:
        """Replicas that lost part of a sync's stream (they live, their weights are partly new) take
        the whole sync again."""
        self._sync(replicas, version, target)

    def _bring_up(self, replicas: list) -> None:
        """A restarted replica gets the weights of the sync in progress, or the current ones."""
        version = self.version if self._in_progress is None else self._in_progress
        self._sync(replicas, version, SyncTarget.ENGINE)
