"""The trainer group: ``parallel.trainer_world_size`` rank actors forming one Megatron world.

The ranks are seated by `moe_rl.orchestration.seats.Seats` (one bundle per rank, a GPU each on GPU
nodes; colocated on GPUs, shared with an engine). Rank 0 publishes an address and a free port; every rank joins the torch.distributed
world there (NCCL on CUDA, gloo on CPU) and Megatron's parallel state follows the recipe
(TP / PP / EP / ETP / CP, data parallelism the rest). The driver calls one verb on every rank at
once and reads rank 0's answer: metrics are reduced inside the group (over data-parallel ranks,
merged over pipeline stages), so every rank holds the same ones.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from typing import Any

import ray

from moe_rl.config.schema import RecipeConfig
from moe_rl.config.sync_plan import SyncPlan
from moe_rl.orchestration.actors import RAY_TIMEOUT_S, TrainerRank
from moe_rl.orchestration.rank_parts import BatchHandle, RankPart
from moe_rl.orchestration.seats import Seats
from moe_rl.weight_sync.protocol import SyncTarget
from moe_rl.weight_sync.report import SyncReport

log = logging.getLogger("moe_rl.driver")


class TrainerGroup:
    """Rank actors of one Megatron world (see the module docstring)."""

    def __init__(self, config: RecipeConfig, seats: Seats, sync: SyncPlan):
        """Seat and start the rank actors; `form` waits for them to form the world (meanwhile
        the caller may start other actors: engines build their models while ranks build theirs).
        The group releases ``seats`` when it shuts down (after the engines). ``sync``: the run's
        weight-sync plan, which every rank follows."""
        self.config, self.seats = config, seats
        placement = seats.placement
        world = placement.trainer_ranks
        seats.reserve_trainer()
        threads = placement.threads("trainer", os.cpu_count() or 1)
        actor = ray.remote(TrainerRank)
        self.ranks = [
            actor.options(**seats.trainer_options(i)).remote(config, i, world, threads, sync)
            for i in range(world)
        ]
        self.layout: list[dict[str, int]] = []
        self._handles = 0

    def form(self) -> None:
        """Wait until every rank has joined the world and built its model part."""
        address, port = ray.get(self.ranks[0].address.remote(), timeout=RAY_TIMEOUT_S)
        self.layout = self._all("init", address, port)
        log.info(
            "trainer group: %d rank(s), data-parallel size %d, store %s:%d",
            len(self.ranks),
            self.dp_size,
            address,
            port,
        )

    def _all(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank at once; every rank's answer."""
        refs = [getattr(rank, method).remote(*args) for rank in self.ranks]
        return ray.get(refs, timeout=RAY_TIMEOUT_S)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (known once the group has formed)."""
        return self.layout[0]["dp_size"]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def old_logp(self, parts: Sequence[RankPart]) -> BatchHandle:
        """The π_old pass of a step's batch: each rank gets the part of its data-parallel rank (and
        fetches its shard by reference); `train` takes the handle returned."""
        self._handles += 1
        handle = self._handles
        refs = [
            rank.old_logp.remote(parts[info["dp_rank"]], handle)
            for rank, info in zip(self.ranks, self.layout)
        ]
        return BatchHandle(handle, ray.get(refs, timeout=RAY_TIMEOUT_S)[0])

    def train(self, prepared: BatchHandle) -> dict[str, float]:
        """One optimizer step per mini-batch of the batch ``prepared`` names, on every rank."""
        return self._all("train", prepared.handle)[0]

    def stream_weights(self, engines: Sequence[Any], target: SyncTarget, whole: bool = True) -> SyncReport:
        """Every rank sends its part of a sync to ``target`` of ``engines`` by the run's sync plan
        (``whole`` False: only what trains, `moe_rl.weight_sync.sender.RankSender.send`); totals over
        the senders."""
        report = SyncReport()
        for part in self._all("stream_weights", list(engines), target, whole):
            report.merge(part)
        return report

    def save_hf(self, directory: str) -> str:
        """A Hugging Face folder of the current weights (collective)."""
        return self._all("save_hf", directory)[0]

    def release_memory(self, params: bool) -> dict[str, float]:
        """Every rank moves what generation does not need out of device memory (colocated); the most
        a rank released and the most one keeps resident."""
        return _most(self._all("release_memory", params))

    def restore_memory(self) -> dict[str, float]:
        """Every rank takes back what `release_memory` moved out; the most one holds."""
        return _most(self._all("restore_memory"))

    def save_checkpoint(self, directory: str) -> None:
        self._all("save_checkpoint", directory)

    def load_checkpoint(self, directory: str) -> int:
        steps = set(self._all("load_checkpoint", directory))
        if len(steps) != 1:
            raise RuntimeError(f"trainer ranks loaded different steps {sorted(steps)} from {directory}")
        return steps.pop()

    def shutdown(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError):  # shared weight-sync slots: removed now
            ray.get([rank.release.remote() for rank in self.ranks], timeout=30)
        for rank in self.ranks:
            ray.kill(rank)
        self.seats.release()


def _most(answers: list[dict[str, float]]) -> dict[str, float]:
    """Each key's largest value over the ranks' answers."""
    return {key: max(a[key] for a in answers) for key in answers[0]}
