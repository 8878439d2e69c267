"""Fault injection, for the tests of the engine restart rule, through one interface: a fault plan
read from one variable of the environment (`FAULTS_ENV`), which the run carries to its engine
processes, and the two points where an engine replica's process may be made to exit as a crash would
(`FaultPoint`). An engine process holds its replica's `Faults` and says when it reaches a point; a
run without the variable has no faults and counts nothing. Imports no Ray."""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

log = logging.getLogger(__name__)

FAULTS_ENV = "MOE_RL_FAULTS"
"""``die_in_generate=R@K`` makes the first process of engine replica R exit inside its K-th
``generate`` call, ``die_in_sync=R@K`` as it lands the K-th weight bucket it receives (over all
syncs); several, comma-separated. The replica restarted after it runs normally."""


class FaultPoint(StrEnum):
    """Where an engine process may be made to exit."""

    GENERATE = "die_in_generate"
    SYNC = "die_in_sync"


@dataclass(frozen=True)
class Fault:
    point: FaultPoint
    replica: int
    call: int
    """The point's call, counted from 1 in the process, at which it exits."""


def parse_faults(spec: str) -> list[Fault]:
    """The faults of a `FAULTS_ENV` value; one that does not read is refused naming the variable."""
    faults = []
    for item in filter(None, spec.split(",")):
        point, _, where = item.partition("=")
        replica, _, call = where.partition("@")
        if point not in set(FaultPoint) or not replica.isdigit() or not call.isdigit():
            points = " or ".join(p.value for p in FaultPoint)
            raise ValueError(f"{FAULTS_ENV}={spec!r}: {item!r} is not <{points}>=<replica>@<call>")
        faults.append(Fault(FaultPoint(point), int(replica), int(call)))
    return faults


class Faults:
    """The faults planned for one engine replica's process, and its calls to each point counted."""

    def __init__(self, replica: int, restarts: int, spec: str | None = None):
        """``spec``: the plan (default: `FAULTS_ENV` of this process); a restarted process
        (``restarts`` > 0) has none."""
        spec = os.environ.get(FAULTS_ENV, "") if spec is None else spec
        self.replica, self.spec = replica, spec
        self.planned = {f for f in parse_faults(spec) if f.replica == replica} if restarts == 0 else set()
        self.calls: Counter[FaultPoint] = Counter()

    def reached(self, point: FaultPoint) -> None:
        """The process reached ``point`` once more: it exits there when the plan says so."""
        if not self.planned:
            return
        self.calls[point] += 1
        if Fault(point, self.replica, self.calls[point]) in self.planned:
            log.error(
                "fault injection (%s=%s): engine replica %d exits (%s)",
                FAULTS_ENV,
                self.spec,
                self.replica,
                point,
            )
            os._exit(1)
