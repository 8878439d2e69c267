"""The Ray actors of a run: trainer ranks, rollout engine replicas and the reward worker.

* `TrainerRank`: one rank of the trainer group (`moe_rl.orchestration.trainer_group`): a
  `moe_rl.orchestration.trainer_host.TrainerHost` in a torch.distributed world that spans the
  group. It fetches its own data-parallel shard of each batch by object reference and streams the
  weights it owns to the engines in buckets (`moe_rl.weight_sync`).
* `EngineActor`: one rollout engine replica (Megatron or vLLM) of the engine pool, a
  `moe_rl.orchestration.engine_host.EngineHost`; receives weight buckets, generates, and runs the
  in-training mismatch probe against a reference model it keeps.
* `RewardActor`: merges the replicas' batches, scores, validates and shards them
  (`moe_rl.orchestration.batches`), so rollout batches travel engine → store → trainer ranks and
  the driver sees only a summary.

Placement (how many of each, which GPUs, which nodes) is `moe_rl.orchestration.placement`'s; the
cluster they live in, `moe_rl.orchestration.ray_cluster`'s.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any

import ray
import torch

from moe_rl.config.run_plan import RunPlan
from moe_rl.config.schema import RecipeConfig
from moe_rl.config.sync_plan import SyncPlan
from moe_rl.device import process_device
from moe_rl.orchestration.engine_host import EngineHost
from moe_rl.orchestration.faults import Faults
from moe_rl.orchestration.trainer_host import TrainerHost
from moe_rl.weight_sync.protocol import SyncTarget
from moe_rl.weight_sync.report import SyncReport
from moe_rl.weight_sync.transport import Receiver

log = logging.getLogger(__name__)

RAY_TIMEOUT_S = 1800.0


def _setup_process(config: RecipeConfig, threads: int, name: str) -> None:
    """Logging into the run's `logs/<name>.log` (`moe_rl.log.setup_actor_logging`), CPU threads."""
    from moe_rl.log import setup_actor_logging

    setup_actor_logging(name, config.logging.level, config.logging.verbose)
    if process_device().type == "cpu":
        torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


SYNC_GROUP = "sync"
"""The engine actors' concurrency group of weight-sync calls with in-flight updates
(`rollout.inflight_updates`): they run in a thread of their own, beside a generation, which the
engine parks at a token boundary for them (`moe_rl.rollout.sync_gate.SyncGate`)."""


def sync_call(engine: Any, method: str, config: RecipeConfig) -> Any:
    """``engine.<method>`` for a weight-sync call: in the sync concurrency group with in-flight
    updates, else in the actor's one queue (after every generation launched before it)."""
    call = getattr(engine, method)
    return call.options(concurrency_group=SYNC_GROUP) if config.rollout.inflight_updates else call


def device_key() -> tuple[str, str | None]:
    """This actor's node and first GPU as Ray assigned it (None without one): a trainer rank and
    the engine seated on its GPU share it (`moe_rl.orchestration.seats`)."""
    gpus = ray.get_gpu_ids()
    return ray.get_runtime_context().get_node_id(), str(gpus[0]) if gpus else None


class TrainerRank:
    """One rank of the trainer group (see the module docstring): a
    `moe_rl.orchestration.trainer_host.TrainerHost` once the rank has joined the group's world."""

    def __init__(self, config: RecipeConfig, rank: int, world_size: int, threads: int, sync: SyncPlan):
        """``sync``: the run's weight-sync plan, decided by the driver."""
        _setup_process(config, threads, f"trainer{rank}")
        self.config, self.rank, self.world_size, self.sync = config, rank, world_size, sync
        self.host: TrainerHost | None = None
        self._engine_places: dict[Any, tuple[str, str | None] | None] = {}  # engine handle -> `device_key`

    def address(self) -> tuple[str, int]:
        """Where the group's torch.distributed store listens (asked of rank 0)."""
        return ray.util.get_node_ip_address(), _free_port()

    def init(self, master_addr: str, master_port: int) -> dict[str, int]:
        """Join the group's world and build the rank (all ranks at once); returns the layout."""
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",  # Ray shows each rank its own GPU only
        )  # fmt: skip
        self.host = TrainerHost(self.config, self.sync, host=ray.util.get_node_ip_address())
        info = self.host.worker.info
        return {"rank": info.rank, "dp_rank": info.dp_rank, "dp_size": info.dp_size, "pp_rank": info.pp_rank}

    def old_logp(self, part, handle: int) -> dict[str, float]:
        """The π_old pass on this rank's `moe_rl.orchestration.rank_parts.RankPart` (its shard fetched
        by reference), kept under ``handle`` until `train` takes it."""
        return self.host.old_logp(ray.get(part.trajectories, timeout=RAY_TIMEOUT_S), part, handle)

    def train(self, handle: int) -> dict[str, float]:
        return self.host.train(handle)

    def stream_weights(self, engines: Sequence[Any], target: SyncTarget, whole: bool = True) -> SyncReport:
        """Send this rank's part of a sync to ``target`` of every engine (on the device route only to
        the engines that share this rank's GPU). This rank's part of the sync's report (with the
        indices of engines that died on the way)."""
        places = {i: self._place_of(engine) for i, engine in enumerate(engines)}
        here = device_key()
        receivers = {
            i: Receiver(
                functools.partial(sync_call(engine, "receive", self.config).remote, into=target),
                key=engine, near=places[i][0] == here[0],
            )
            for i, engine in enumerate(engines)
            if places[i] is not None and (not self.sync.same_device or places[i] == here)
        }  # fmt: skip
        report = self.host.send(receivers, target, RAY_TIMEOUT_S, whole)
        report.dead |= {i for i, place in places.items() if place is None}
        return report

    def _place_of(self, engine: Any) -> tuple[str, str | None] | None:
        """An engine's `device_key` (its node and GPU), asked once per engine process (None: its
        process is gone)."""
        if engine not in self._engine_places:
            try:
                self._engine_places[engine] = tuple(
                    ray.get(engine.device_key.remote(), timeout=RAY_TIMEOUT_S)
                )
            except ray.exceptions.RayActorError:
                self._engine_places[engine] = None
        return self._engine_places[engine]

    def release_memory(self, params: bool) -> dict[str, float]:
        return self.host.release_memory(params)

    def restore_memory(self) -> dict[str, float]:
        return self.host.restore_memory()

    def release(self) -> None:
        """Remove this rank's shared weight-sync slots and arena file (before the actor is killed)."""
        if self.host is not None:
            self.host.close()

    def save_hf(self, directory: str) -> str:
        """This group's weights as a Hugging Face folder (collective; every rank writes its own)."""
        return self.host.save_hf(directory)

    def save_checkpoint(self, directory: str) -> str:
        return self.host.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> int:
        return self.host.load_checkpoint(directory)


class EngineActor(EngineHost):
    """One rollout engine replica as a Ray actor (see the module docstring)."""

    def __init__(
        self, config: RecipeConfig, plan: RunPlan, model_path: str | None, replica: int, threads: int,
        restarts: int = 0, env_factory=None, visible_gpus: list[str] | None = None,
    ):  # fmt: skip
        """``plan``: the run's plan, decided by the driver; ``visible_gpus``: the GPUs a colocated
        engine computes on, its own first (`moe_rl.orchestration.seats.Seats.visible_gpus`), set
        before anything touches CUDA."""
        if visible_gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        _setup_process(config, threads, f"engine{replica}")
        super().__init__(config, plan, model_path, replica, env_factory, Faults(replica, restarts))

    @ray.method(num_returns=2)
    def generate(self, prompts: Sequence[Any], sampling, group_ids: Sequence[int]):
        """``(batch, status)``: the driver waits on the small status, the batch goes on by reference."""
        return super().generate(prompts, sampling, group_ids)

    def device_key(self) -> tuple[str, str | None]:
        return device_key()


PROGRESS_GROUP = "progress"
"""The reward actor's concurrency group of progress questions (`RewardActor.progress`): answered in
a thread of their own while the actor scores."""


class RewardActor:
    """The reward worker as a Ray actor (`moe_rl.orchestration.batches.Rewarder`): rollout batches
    travel engine → store → trainer ranks, and the driver reads only their summary, and, while a
    scoring runs, its progress (in `PROGRESS_GROUP`)."""

    def __init__(self, config: RecipeConfig, scorer=None):
        _setup_process(config, 1, "reward")
        from moe_rl.orchestration.batches import Rewarder

        self.rewarder = Rewarder(config, scorer)

    @ray.method(num_returns=2)
    def prepare(
        self, batch_refs: Sequence[Any], plan, prompts, version: int, dp_size: int, round_: int = 0,
        group_ids: Sequence[int] = (),
    ):  # fmt: skip
        """``(shard refs, summary)`` of the replicas' batches (fetched by reference)."""
        parts = ray.get(list(batch_refs), timeout=RAY_TIMEOUT_S)
        shards, summary = self.rewarder.prepare(parts, plan, prompts, version, dp_size, round_, group_ids)
        return [ray.put(shard) for shard in shards], summary

    @ray.method(num_returns=2)
    def prepare_stored(self, batch, version: int, dp_size: int):
        """``(shard refs, summary)`` of a stored batch (offline DGO)."""
        shards, summary = self.rewarder.prepare_stored(batch, version, dp_size)
        return [ray.put(shard) for shard in shards], summary

    def progress(self) -> str | None:
        """Where the scoring in progress stands (None: none is)."""
        return self.rewarder.progress()

    def dump(self, folder: str, step: int, scored: int) -> None:
        self.rewarder.dump(folder, step, scored)
