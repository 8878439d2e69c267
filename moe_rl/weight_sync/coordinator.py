"""The weight-sync coordinator: it runs a sync from the trainer to the engines, which do not know
each other.

A sync of policy ``version`` into a `moe_rl.weight_sync.receiver.SyncTarget` of some replicas:
the engine pool tells them it begins (`begin`), the trainer streams its buckets to them (each rank
its own tensors, `moe_rl.weight_sync.sender.RankSender`), and the pool has each take the version
when its last bucket has landed (`finish`). The pool answers which replicas did not take it
(`Begun`, `Finished`): those it restarted (a new process, without weights) and live
ones whose weight stream broke (their weights partly new). The coordinator runs the sync again for
them, in a loop: a replica is restarted at most `moe_rl.orchestration.engine_pool.
MAX_ENGINE_RESTARTS` times (the pool's limit), and a stream that breaks more than
`MAX_STREAM_BREAKS` times in a row stops the run. It returns the first attempt's `SyncReport`,
whose `SyncReport.metrics` are the run's ``sync/*`` and ``quant/*`` metrics.

A replica the pool restarts outside a sync (in a generation, or between the memory phases) is
brought to the engines' weights by `bring_up`, which the stage that saw the restart calls. The
policy version the engines hold is the run's (`moe_rl.orchestration.run_state.RunState.version`);
the coordinator keeps one thing: which replicas hold a LoRA run's frozen base (``lora.sync=adapters``,
`moe_rl.config.sync_plan.SyncPlan.adapters`). A sync into replicas that all do carries only what
trains; one into a replica that does not (new, or restarted) carries everything.

It works against two small interfaces, so the Ray run and the one-process loop share it: a trainer
that streams weights (`SyncTrainer`: ``stream_weights(actors, target, whole) -> SyncReport``, by the
run's sync plan) and an engine pool (`SyncEngines`: ``replicas``, ``begin``, ``finish``, each
replica a `SyncReplica` whose ``actor`` takes the messages of `moe_rl.weight_sync.protocol`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from moe_rl.weight_sync.protocol import SyncTarget
from moe_rl.weight_sync.report import SyncReport

log = logging.getLogger("moe_rl.driver")

MAX_STREAM_BREAKS = 2
"""Syncs in a row a live replica whose weight stream broke takes again; one more break stops the run."""


class SyncReplica(Protocol):
    """One engine replica as a sync sees it: its index in the pool and its process (``actor``: a Ray
    actor, or the engine host in this process), which takes the messages of a sync."""

    index: int
    actor: Any


@dataclass
class Begun:
    """The pool's answer to a sync's ``begin``: the replicas told that it begins, and those whose
    process had died (restarted: they take the sync again)."""

    began: list[SyncReplica]
    restarted: list[SyncReplica] = field(default_factory=list)


@dataclass
class Finished:
    """The pool's answer to a sync's ``finish``: what the last replica that took the version reported,
    the replicas whose process died on the way (restarted) and the live ones whose weight stream
    broke (``cut_off``, their weights partly new; ``error``: the last break's cause). Both take the
    sync again."""

    received: dict[str, Any] = field(default_factory=dict)
    restarted: list[SyncReplica] = field(default_factory=list)
    cut_off: list[SyncReplica] = field(default_factory=list)
    error: Exception | None = None


class SyncTrainer(Protocol):
    """The trainer side of a sync: every rank streams what it owns to the given replicas' processes."""

    def stream_weights(
        self, engines: Sequence[Any], target: SyncTarget, whole: bool = True
    ) -> SyncReport: ...


class SyncEngines(Protocol):
    """The engine side of a sync: replicas that begin, receive (through their ``actor``) and finish."""

    replicas: Sequence[SyncReplica]

    def begin(self, version: int, replicas: Sequence[SyncReplica], target: SyncTarget) -> Begun: ...

    def finish(
        self, version: int, replicas: Sequence[SyncReplica], dead: set[int], target: SyncTarget
    ) -> Finished: ...


class WeightSync:
    """Runs syncs from ``trainer`` to ``engines`` (see the module docstring)."""

    def __init__(self, trainer: SyncTrainer, engines: SyncEngines):
        self.trainer, self.engines = trainer, engines
        self._holding: set[int] = set()
        """Replicas that took a whole sync since their process started (they hold the frozen base)."""

    def run(
        self, version: int, target: SyncTarget = SyncTarget.ENGINE, replicas: list[SyncReplica] | None = None
    ) -> SyncReport:
        """Sync ``version`` into ``target`` of ``replicas`` (default: every replica), until each
        has taken it."""
        start = time.perf_counter()
        report = self._sync(self.engines.replicas if replicas is None else replicas, version, target)
        report.seconds = time.perf_counter() - start
        return report

    def bring_up(self, replicas: list[SyncReplica], version: int) -> None:
        """Restarted replicas (new processes, without weights) take the engines' ``version``."""
        self._holding -= {replica.index for replica in replicas}
        if replicas:
            self._sync(replicas, version, SyncTarget.ENGINE)

    def _sync(self, replicas: list[SyncReplica], version: int, target: SyncTarget) -> SyncReport:
        """Attempts until every replica of ``replicas`` has taken the sync (see the module docstring;
        the loop ends: the pool bounds each replica's restarts, `MAX_STREAM_BREAKS` the breaks in a
        row). A sync into the probe's reference is of the engines' version, which a restarted
        replica takes first."""
        report: SyncReport | None = None
        todo, breaks = list(replicas), 0
        while todo:
            attempt, finished, restarted = self._attempt(todo, version, target)
            if report is None or not report.buckets:  # the first attempt that streamed is the sync's
                report = attempt
            report.received = report.received or finished.received
            if target != SyncTarget.ENGINE:  # a new process needs the engines' weights first
                self.bring_up(restarted, version)
            breaks = breaks + 1 if finished.cut_off else 0
            if finished.cut_off:
                self._check_breaks(finished, breaks)
            todo = restarted + finished.cut_off
        return report or SyncReport(version)

    def _attempt(
        self, replicas: list[SyncReplica], version: int, target: SyncTarget
    ) -> tuple[SyncReport, Finished, list[SyncReplica]]:
        """One pass of begin, stream and finish over ``replicas``; its report, the pool's answer to
        `finish` and every replica restarted on the way."""
        begun = self.engines.begin(version, replicas, target)
        self._holding -= {replica.index for replica in begun.restarted}
        if not begun.began:
            return SyncReport(version), Finished(), begun.restarted
        whole = any(replica.index not in self._holding for replica in begun.began)
        report = self.trainer.stream_weights([r.actor for r in begun.began], target, whole)
        report.version = version
        dead = {begun.began[i].index for i in report.dead}
        finished = self.engines.finish(version, begun.began, dead, target)
        failed = {replica.index for replica in finished.restarted + finished.cut_off}
        self._holding -= {replica.index for replica in finished.restarted}
        if whole and target == SyncTarget.ENGINE:
            self._holding |= {replica.index for replica in begun.began if replica.index not in failed}
        return report, finished, begun.restarted + finished.restarted

    @staticmethod
    def _check_breaks(finished: Finished, breaks: int) -> None:
        """Cut-off replicas take the sync again, unless their stream broke too often in a row."""
        names = ", ".join(str(replica.index) for replica in finished.cut_off)
        if breaks > MAX_STREAM_BREAKS:
            raise RuntimeError(
                f"the weight stream to engine replicas {names} broke {breaks} times in a row; "
                f"last error: {finished.error}"
            ) from finished.error
        error = finished.error
        log.warning(
            "engine replicas %s lost part of the weight stream (%s); syncing them again", names, error
        )
