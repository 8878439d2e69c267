"""Where Ray seats a run's trainer ranks and engine replicas (`moe_rl.orchestration.placement` says
what each gets): the placement groups, and the actor options of each rank and replica.

* Trainer ranks: one placement group of one bundle per rank, packed; colocated on a GPU cluster,
  one group per node (``STRICT_PACK``) of one bundle per GPU, rank ``r`` in bundle ``r % gpus`` of
  group ``r // gpus``, so the ranks of a node fill its GPUs in order.
* Engines, disaggregated: a placement group of their own each (made when the replica starts,
  removed when it is killed).
* Engines, colocated on a GPU cluster: replica ``j`` of tensor parallelism ``t`` sits in the bundle
  of its first GPU, trainer rank ``j * t``'s, and sees the ``t`` GPUs of ranks ``j * t`` to
  ``j * t + t - 1`` (`visible_gpus`, which the engine's process sets as ``CUDA_VISIBLE_DEVICES``
  before anything touches CUDA). Which GPU a bundle reserved is asked once, by a tiny task in it.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moe_rl.orchestration.placement import PLACEMENT_TIMEOUT_S, Placement

PROBE_GPU = 0.01
"""The share of a GPU the task that asks which GPU a bundle reserved declares."""


@ray.remote(num_cpus=0)
def _gpu_ids() -> list[str]:
    return [str(i) for i in ray.get_gpu_ids()]


class Seats:
    """The placement groups of one run and the actor options of its ranks and replicas (see the
    module docstring)."""

    def __init__(self, placement: Placement):
        self.placement = placement
        self.trainer_groups: list[Any] = []
        self.bundle_gpus: list[list[str]] = []
        """Per trainer group, per bundle: the GPU the bundle reserved (colocated on GPUs)."""
        self.engine_groups: dict[int, Any] = {}

    # ------------------------------------------------------------------ trainer
    def reserve_trainer(self) -> None:
        """Reserve the trainer's bundles (waiting until Ray has found room for them)."""
        p = self.placement
        if p.shares_gpus:
            nodes = -(-p.trainer_ranks // p.gpus_per_node)
            self.trainer_groups = [
                placement_group([p.trainer_bundle()] * p.gpus_per_node, strategy="STRICT_PACK")
                for _ in range(nodes)
            ]
        else:
            self.trainer_groups = [placement_group([p.trainer_bundle()] * p.trainer_ranks, strategy="PACK")]
        for group in self.trainer_groups:
            if not ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S):
                raise RuntimeError(f"no room for {p.trainer_ranks} trainer ranks of {p.trainer_bundle()}")
        if p.shares_gpus:
            self.bundle_gpus = [
                [self._gpu_of(group, i) for i in range(p.gpus_per_node)] for group in self.trainer_groups
            ]

    @staticmethod
    def _gpu_of(group: Any, index: int) -> str:
        """The GPU bundle ``index`` of ``group`` reserved (asked by a tiny task in it)."""
        probe = _gpu_ids.options(num_gpus=PROBE_GPU, scheduling_strategy=_in(group, index))
        (gpu,) = ray.get(probe.remote(), timeout=PLACEMENT_TIMEOUT_S)
        return gpu

    def _trainer_seat(self, rank: int) -> tuple[Any, int]:
        if self.placement.shares_gpus:
            per = self.placement.gpus_per_node
            return self.trainer_groups[rank // per], rank % per
        return self.trainer_groups[0], rank

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """The Ray actor options of trainer rank ``rank``."""
        group, index = self._trainer_seat(rank)
        return {
            "num_cpus": 0,
            "num_gpus": self.placement.trainer_gpus,
            "scheduling_strategy": _in(group, index),
        }

    # ------------------------------------------------------------------ engines
    def engine_options(self, replica: int, colocated_roles: bool) -> dict[str, Any]:
        """The Ray actor options of engine replica ``replica`` (disaggregated: its placement group is
        made here; ``colocated_roles``: its bundle is pinned to a trainer node)."""
        p = self.placement
        if p.shares_gpus:
            group, index = self._trainer_seat(replica * p.engine_tp)
        else:
            group, index = placement_group([p.engine_bundle(colocated_roles)], strategy="PACK"), 0
            if not ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S):
                raise RuntimeError(
                    f"no room for engine replica {replica} of {p.engine_bundle(colocated_roles)}"
                )
            self.engine_groups[replica] = group
        return {"num_cpus": 0, "num_gpus": p.engine_gpus, "scheduling_strategy": _in(group, index)}

    def visible_gpus(self, replica: int) -> list[str] | None:
        """The GPUs colocated engine ``replica`` computes on, its own first (None: what Ray gives it)."""
        p = self.placement
        if not p.shares_gpus:
            return None
        first = replica * p.engine_tp
        per = p.gpus_per_node
        return self.bundle_gpus[first // per][first % per : first % per + p.engine_tp]

    def release_engine(self, replica: int) -> None:
        """Remove the placement group of a disaggregated replica (a colocated one has none)."""
        group = self.engine_groups.pop(replica, None)
        if group is not None:
            remove_placement_group(group)

    def release(self) -> None:
        for replica in list(self.engine_groups):
            self.release_engine(replica)
        for group in self.trainer_groups:
            remove_placement_group(group)
        self.trainer_groups = []


def _in(group: Any, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
