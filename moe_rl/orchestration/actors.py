"""The Ray actors of a run: trainer ranks, rollout engine replicas and the reward worker.

* `TrainerRank`: one rank of the trainer group (`moe_rl.orchestration.trainer_group`): one
  `moe_rl.trainer.worker.TrainerWorker` in a torch.distributed world that spans the group. It
  fetches its own data-parallel shard of each batch by object reference and streams the weights
  it owns to the engines in buckets (`moe_rl.weight_sync`).
* `EngineActor`: one rollout engine replica (Megatron or vLLM) of the engine pool; receives weight
  buckets, generates, and runs the in-training mismatch probe against a reference model it keeps.
* `RewardActor`: merges the replicas' batches, scores, validates and shards them
  (`moe_rl.orchestration.batches`), so rollout batches travel engine → store → trainer ranks and
  the driver sees only a summary.

Placement (how many of each, which GPUs, which nodes) is `moe_rl.orchestration.placement`'s.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from moe_rl.config.modes import Engine
from moe_rl.config.schema import RecipeConfig
from moe_rl.device import process_device
from moe_rl.log import LOG_DIR_ENV
from moe_rl.orchestration.placement import PROCESS_ENV

log = logging.getLogger(__name__)

RAY_TIMEOUT_S = 1800.0
FAULTS_ENV = "MOE_RL_FAULTS"
"""Fault injection for tests of the restart rule: ``die_in_generate=R@K`` makes the first process
of engine replica R exit (as a crash would) inside its K-th ``generate`` call; the replica
restarted after it runs normally."""


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


class TrainerRank:
    """One rank of the trainer group (see the module docstring)."""

    def __init__(self, config: RecipeConfig, rank: int, world_size: int, threads: int):
        _setup_process(config, threads, f"trainer{rank}")
        self.config, self.rank, self.world_size = config, rank, world_size
        self.worker = None
        self._packer = None  # the bucket buffers (or shared slots), kept from sync to sync
        self._arena = None  # this rank's CPU parameters in shared memory, once a sync uses the slots
        self._engine_nodes: dict[str, str | None] = {}
        self._prepared: dict = {}  # handle -> the batch its π_old pass prepared (`old_logp` / `train`)

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """Where the group's torch.distributed store listens (asked of rank 0)."""
        return ray.util.get_node_ip_address(), _free_port()

    def init(self, master_addr: str, master_port: int) -> dict[str, int]:
        """Join the group's world and build the worker (all ranks at once); returns the layout."""
        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",  # Ray shows each rank its own GPU only
        )  # fmt: skip
        from moe_rl.trainer.worker import TrainerWorker

        self.worker = TrainerWorker(self.config)
        info = self.worker.info
        return {"rank": info.rank, "dp_rank": info.dp_rank, "dp_size": info.dp_size, "pp_rank": info.pp_rank}

    def old_logp(self, part, handle: int) -> dict[str, float]:
        """The π_old pass on this rank's `moe_rl.orchestration.batches.RankPart` (its shard fetched
        by reference); the prepared batch is kept under ``handle`` until `train` takes it."""
        from moe_rl.trainer.batch import TrainerBatch

        shard = ray.get(part.trajectories, timeout=RAY_TIMEOUT_S)
        prepared = self.worker.old_logp(
            TrainerBatch.of_share(shard, part.advantages, part.share, part.zvp_signs)
        )
        self._prepared = {handle: prepared}  # a new step's batch replaces one never trained on
        return prepared.metrics

    def train(self, handle: int) -> dict[str, float]:
        """One optimizer step per mini-batch of the batch prepared under ``handle``."""
        prepared = self._prepared.pop(handle, None)
        if prepared is None:
            raise RuntimeError(f"trainer rank {self.rank}: no batch prepared under handle {handle}")
        return self.worker.train(prepared)

    def stream_weights(self, engines: Sequence[Any], quantized_wire: bool, into: str) -> dict[str, Any]:
        """Send the tensors this rank owns to every engine, bucket by bucket (see
        `moe_rl.weight_sync.sender`): through shared-memory slots when every engine runs on this
        node, else through the object store. Returns the bytes, bucket count, quantization report
        and the indices of engines that died on the way."""
        from moe_rl.weight_sync.sender import publish, stream_buckets
        from moe_rl.weight_sync.wire import WireEncoder

        config = self.config
        encoder = WireEncoder(config.quant, config.model.num_layers, quantized_wire=quantized_wire)
        nodes = self._nodes_of(engines)
        dead = {i for i, node in nodes.items() if node is None}
        shared = all(node == ray.get_runtime_context().get_node_id() for node in nodes.values() if node)
        packer = self._packer_for(config.rollout.sync_bucket_mb << 20, shared)
        receivers = {
            i: functools.partial(engine.receive_bucket.remote, into=into)
            for i, engine in enumerate(engines)
            if i not in dead
        }
        buckets = stream_buckets(self.worker.model, encoder, packer.capacity, self.rank, packer)
        out = publish(buckets, receivers, RAY_TIMEOUT_S)
        return {"bytes": out.bytes, "in_place": out.in_place, "buckets": out.buckets, "report": encoder.report if encoder.active else None,
                "dead": sorted(dead | out.dead), "shared_memory": int(shared)}  # fmt: skip

    def release(self) -> None:
        """Remove this rank's shared weight-sync slots and arena file (before the actor is killed)."""
        if self._packer is not None and self._packer.slots is not None:
            self._packer.slots.close()
        if self._arena is not None:
            self._arena.close()
        self._packer = self._arena = None

    def _packer_for(self, capacity: int, shared: bool):
        """The rank's packer, kept from sync to sync (its buffers or shared slots are reused). With
        shared slots on CPU the rank's parameters move into a shared arena once (`weight_sync.sender.
        share_parameters`), so the engines read the tensors that travel as they are in place."""
        from moe_rl.weight_sync.buckets import BucketPacker
        from moe_rl.weight_sync.sender import sends, share_parameters
        from moe_rl.weight_sync.shm import SharedSlots

        if shared and self._arena is None and self.worker.device.type == "cpu":
            self._arena = share_parameters(self.worker.model, tag=str(self.rank), select=sends)
        packer = self._packer
        if packer is None or packer.capacity != capacity or (packer.slots is not None) != shared:
            if packer is not None and packer.slots is not None:
                packer.slots.close()
            slots = SharedSlots(capacity, tag=str(self.rank)) if shared else None
            arena = self._arena if shared else None
            self._packer = packer = BucketPacker(capacity, sender=self.rank, slots=slots, arena=arena)
        return packer

    def _nodes_of(self, engines: Sequence[Any]) -> dict[int, str | None]:
        """Each engine's node id (None: its process is gone), asked once per engine actor."""
        for engine in engines:
            key = engine._actor_id.hex()
            if key not in self._engine_nodes:
                try:
                    self._engine_nodes[key] = ray.get(engine.node_id.remote(), timeout=RAY_TIMEOUT_S)
                except ray.exceptions.RayActorError:
                    self._engine_nodes[key] = None
        return {i: self._engine_nodes[e._actor_id.hex()] for i, e in enumerate(engines)}

    def save_hf(self, directory: str) -> str:
        """This group's weights as a Hugging Face folder (collective; every rank writes its own)."""
        from moe_rl.megatron.hf_weights import save_hf_checkpoint
        from moe_rl.megatron.model import model_config_to_hf_config
        from moe_rl.weight_sync.sender import sends

        hf_config = model_config_to_hf_config(self.config.model)
        save_hf_checkpoint(self.worker.model, directory, hf_config, select=sends)
        return directory

    def save_checkpoint(self, directory: str) -> str:
        return str(self.worker.save_checkpoint(directory))

    def load_checkpoint(self, directory: str) -> int:
        return self.worker.load_checkpoint(directory)


class EngineActor:
    """One rollout engine replica (see the module docstring)."""

    def __init__(
        self, config: RecipeConfig, model_path: str | None, replica: int, threads: int, restarts: int = 0,
        env_factory=None,
    ):  # fmt: skip
        """``env_factory``: the environment maker the preflight built (`env.name`; built here when
        not given)."""
        _setup_process(config, threads, f"engine{replica}")
        self.config, self.replica, self.restarts = config, replica, restarts
        self.engine = make_engine(config, model_path)
        from moe_rl.envs.rollout import rollouts_for

        self.rollouts = rollouts_for(config, self.engine, env_factory)  # single- or multi-turn (`env.name`)
        self._reference = None
        self._generates = 0

    def pid(self) -> int:
        return os.getpid()

    @ray.method(num_returns=2)
    def generate(self, prompts: Sequence[Any], sampling, group_ids: Sequence[int]):
        """``(batch, status)`` for `moe_rl.rewards.tasks.Prompt` s: the driver waits on the small status
        (with the environment's counts of a multi-turn rollout), the batch goes on by reference."""
        self._generates += 1
        if self.restarts == 0:
            _maybe_fail(self.replica, self._generates)
        batch, env = self.rollouts.generate(prompts, sampling, group_ids)
        return batch, {"replica": self.replica, "samples": batch.num_samples, "env": env}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def begin_weight_update(self, version: int, into: str = "engine") -> None:
        self._target(into).begin_weight_update(version)

    def receive_bucket(self, bucket, into: str = "engine") -> dict[str, float]:
        return self._target(into).receive_bucket(bucket)

    def finish_weight_update(self, version: int, into: str = "engine") -> dict[str, float]:
        return self._target(into).finish_weight_update(version)

    def policy_version(self) -> int:
        return self.engine.policy_version

    def capabilities(self):
        return self.engine.capabilities

    def _target(self, into: str):
        if into == "engine":
            return self.engine
        if into != "reference":
            raise ValueError(f"weights go into 'engine' or 'reference', not {into!r}")
        if self._reference is None:
            from moe_rl.diagnostics.probe import ReferenceModel

            self._reference = ReferenceModel(self.config)
        return self._reference

    def probe(self, prompts) -> dict[str, float | str]:
        """The zero-update mismatch probe (`moe_rl.diagnostics.probe`): the engine as it is now vs
        the full-precision reference model, which the last reference sync filled."""
        from moe_rl.diagnostics.probe import mismatch_probe

        return mismatch_probe(self.engine, self._target("reference").model, prompts, self.config)


def _maybe_fail(replica: int, call: int) -> None:
    spec = os.environ.get(FAULTS_ENV, "")
    for item in filter(None, spec.split(",")):
        kind, _, where = item.partition("=")
        target, _, at = where.partition("@")
        if kind == "die_in_generate" and int(target) == replica and int(at) == call:
            log.error(
                "fault injection (%s=%s): engine replica %d exits in generate", FAULTS_ENV, spec, replica
            )
            os._exit(1)


class RewardActor:
    """Scores and prepares rollout batches away from the driver (`moe_rl.orchestration.batches`)."""

    def __init__(self, config: RecipeConfig, scorer=None):
        """``scorer``: the scorer the preflight built (`data.reward`; built here when not given,
        None with an environment, whose rewards are in the batch)."""
        _setup_process(config, 1, "reward")
        from moe_rl.orchestration.batches import step_scorer

        self.config = config
        self.scorer = scorer if scorer is not None else step_scorer(config)

    @ray.method(num_returns=2)
    def prepare(self, batch_refs: Sequence[Any], plan, prompts, version: int, dp_size: int):
        """Merge the replicas' batches in prompt order, score, validate, check staleness and shard:
        ``(shard refs, summary)``; the summary is all the driver reads."""
        from moe_rl.orchestration.batches import engine_metrics, merge, step_rewards

        parts = ray.get(list(batch_refs), timeout=RAY_TIMEOUT_S)
        batch = merge(parts, plan)
        rewards = step_rewards(self.scorer, batch, prompts, plan.group_size)
        return self._shard(batch, rewards, version, dp_size, engine_metrics(parts))

    @ray.method(num_returns=2)
    def prepare_stored(self, batch, version: int, dp_size: int):
        """A stored batch (offline DGO, rewards already in it): validate and shard."""
        return self._shard(batch, batch.rewards.tolist(), version, dp_size, {}, staleness=10**9)

    def _shard(self, batch, rewards, version: int, dp_size: int, extra: dict, staleness: int | None = None):
        from moe_rl.orchestration.batches import prepare

        t = self.config.trainer
        batch, summary = prepare(
            batch, rewards, version, self.config.run.max_staleness if staleness is None else staleness,
            vocab_size=self.config.model.vocab_size, dp_size=dp_size,
            max_tokens_per_microbatch=t.max_tokens_per_microbatch, num_mini_batches=t.num_mini_batches,
        )  # fmt: skip
        summary.metrics.update(extra)
        self._last = batch
        shards = [] if summary.plan is None else [ray.put(batch.select(idx)) for idx in summary.plan.indices]
        return shards, summary

    def dump(self, folder: str, step: int) -> None:
        """Write the last prepared batch as trajectory shards (`logging.dump_trajectories`)."""
        from moe_rl.data.shards import write_shards

        batch = self._last
        write_shards([batch], folder, max_samples_per_shard=batch.num_samples, metadata={"step": step})


def make_engine(config: RecipeConfig, model_path: str | None = None):
    """The engine of `rollout.engine`, after the capability checks for this machine."""
    from moe_rl.rollout.capabilities import check_recipe

    check_recipe(config)
    if config.rollout.engine == Engine.MEGATRON:
        from moe_rl.rollout.megatron_engine import MegatronEngine

        return MegatronEngine(config)
    from moe_rl.rollout.vllm_engine import VLLMEngine

    if model_path is None:
        raise ValueError("rollout.engine=vllm starts from a Hugging Face folder; none was written")
    return VLLMEngine.from_recipe(config, model_path)


def start_ray(config: RecipeConfig, log_dir: Path | None = None) -> bool:
    """Join the Ray cluster of a Slurm job (RAY_ADDRESS) or start a local one sized for the run's
    processes; returns whether this call started Ray (then the caller shuts it down). With
    ``log_dir`` every actor logs into it (`moe_rl.log.setup_actor_logging`); Ray still forwards
    what an actor prints to stderr (the project's warnings and errors, a crash) to this terminal."""
    if ray.is_initialized():
        return False
    for key, value in PROCESS_ENV.items():  # inherited by the local cluster's processes
        os.environ.setdefault(key, value)
    logs = {LOG_DIR_ENV: str(Path(log_dir).resolve())} if log_dir else {}
    address = os.environ.get("RAY_ADDRESS")
    if address:  # the cluster's workers were started by others: the job's runtime env carries it
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": logs} if logs else None)
        return True
    os.environ.update(logs)  # the local cluster's workers inherit the driver's environment
    processes = config.parallel.trainer_world_size + config.rollout.num_engines + 1
    ray.init(num_cpus=max(processes, os.cpu_count() or 2), include_dashboard=False, log_to_driver=True)
    return True
