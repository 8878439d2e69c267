"""Ray actors for the trainer, the rollout engine and the reward workers, and their placement.

On one CPU machine everything is colocated (each actor is a process; the stages of a synchronous
step do not overlap, so each actor may use every core). On GPU nodes the trainer gets the
trainer GPUs and each engine its own (disaggregated), as `cluster.rollout_nodes` says.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import ray
import torch

from moe_rl.config.schema import RecipeConfig
from moe_rl.device import Machine, process_device, resolve_device

log = logging.getLogger(__name__)


def _setup_process(config: RecipeConfig) -> None:
    from moe_rl.log import setup_logging

    setup_logging(config.logging.level)
    if process_device().type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))


class TrainerActor:
    """The Megatron trainer (`moe_rl.trainer.worker.TrainerWorker`) in its own process."""

    def __init__(self, config: RecipeConfig):
        _setup_process(config)
        from moe_rl.trainer.worker import TrainerWorker

        self.config = config
        self.worker = TrainerWorker(config)
        self.micro_batches: list = []

    def pid(self) -> int:
        return os.getpid()

    def compute_old_logp(self, batch, advantages: torch.Tensor) -> dict[str, float]:
        """Pack the batch with its advantages and run the π_old pass (diagnostics returned)."""
        from moe_rl.trainer.batch import make_train_micro_batches

        trainer = self.config.trainer
        self.micro_batches = make_train_micro_batches(
            batch, advantages, trainer.max_tokens_per_microbatch, num_microbatches=None
        )
        if len(self.micro_batches) < trainer.num_mini_batches:
            self.micro_batches = make_train_micro_batches(
                batch,
                advantages,
                trainer.max_tokens_per_microbatch,
                num_microbatches=trainer.num_mini_batches,
            )
        return self.worker.compute_old_logp(self.micro_batches)

    def train(self) -> dict[str, float]:
        """One optimizer step per mini-batch over the packed batch; metrics averaged."""
        from moe_rl.trainer.batch import split_mini_batches

        per_step = [
            self.worker.train_step(mini)
            for mini in split_mini_batches(self.micro_batches, self.config.trainer.num_mini_batches)
        ]
        self.micro_batches = []
        keys = {k for m in per_step for k in m}
        return {k: sum(m[k] for m in per_step if k in m) / sum(k in m for m in per_step) for k in keys}

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (name, tensor.detach().to("cpu", copy=True)) for name, tensor in self.worker.export_hf_weights()
        ]

    def save_hf(self, directory: str) -> str:
        """Write the current weights as a Hugging Face folder (what vLLM starts from)."""
        from moe_rl.trainer.hf_weights import save_hf_checkpoint
        from moe_rl.trainer.model import model_config_to_hf_config

        save_hf_checkpoint(self.worker.model, directory, model_config_to_hf_config(self.config.model))
        return directory

    def save_checkpoint(self, directory: str) -> str:
        return str(self.worker.save_checkpoint(directory))

    def load_checkpoint(self, directory: str) -> int:
        return self.worker.load_checkpoint(directory)


class EngineActor:
    """A rollout engine (Megatron or vLLM) in its own process."""

    def __init__(self, config: RecipeConfig, model_path: str | None = None):
        _setup_process(config)
        self.config = config
        self.engine = make_engine(config, model_path)
        self._reference = None

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: Sequence[Sequence[int]], sampling, group_ids: Sequence[int]):
        return self.engine.generate(prompts, sampling, group_ids)

    def update_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        return self.engine.update_weights(named, version)

    def policy_version(self) -> int:
        return self.engine.policy_version

    def probe(self, weights: list[tuple[str, torch.Tensor]], prompts) -> dict[str, float]:
        """The zero-update mismatch probe (`moe_rl.diagnostics.probe`): the engine as it is now
        vs a full-precision model holding the trainer's current `weights`."""
        from moe_rl.diagnostics.probe import mismatch_probe
        from moe_rl.trainer.hf_weights import load_hf_weights

        if self._reference is None:
            from moe_rl.trainer.model import build_gpt_model
            from moe_rl.trainer.parallel import init_parallel

            init_parallel(self.config.parallel)
            self._reference = build_gpt_model(self.config.model, self.config.parallel, self.config.trainer)
            self._reference.eval()
        load_hf_weights(self._reference, dict(weights))
        return mismatch_probe(self.engine, self._reference, prompts, self.config)


class RewardActor:
    """Scores responses (`moe_rl.rewards.RewardScorer`) away from the driver process."""

    def __init__(self, config: RecipeConfig):
        _setup_process(config)
        from moe_rl.rewards.registry import build_scorer

        self.scorer = build_scorer(config)

    def score(self, prompts, responses) -> list[float]:
        return self.scorer.score_all(prompts, responses)


def make_engine(config: RecipeConfig, model_path: str | None = None):
    """The engine of `rollout.engine`, after the capability checks for this machine."""
    from moe_rl.rollout.capabilities import check_recipe

    check_recipe(config)
    if config.rollout.engine == "megatron":
        from moe_rl.rollout.megatron_engine import MegatronEngine

        return MegatronEngine(config)
    from moe_rl.rollout.vllm_engine import VLLMEngine

    if model_path is None:
        raise ValueError("rollout.engine=vllm starts from a Hugging Face folder; none was written")
    return VLLMEngine.from_recipe(config, model_path)


def start_ray(config: RecipeConfig) -> None:
    """Join the Ray cluster of a Slurm job (RAY_ADDRESS) or start a local one."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=True)


SHARED_GPU = 0.5
"""GPU share of the trainer and of the engine when both run on this machine's one GPU."""


def _options(config: RecipeConfig, role: str, machine: Machine | None = None) -> dict[str, Any]:
    """Ray resources of an actor. The device is ``run.device`` resolved on this machine: a CPU run
    asks for no GPU (so Ray hides the GPUs from the actor); a CUDA run on a cluster
    (``cluster.gpus_per_node > 0``) gives the trainer a GPU and each engine its tensor-parallel
    GPUs, and on a single machine (``gpus_per_node = 0``) trainer and engine share its GPU."""
    cuda = resolve_device(config.run.device, machine or Machine.detect()) == "cuda"
    if role == "reward":
        return {"num_cpus": 0}
    if not cuda:
        return {"num_cpus": 1, "num_gpus": 0}
    if config.cluster.gpus_per_node == 0:
        return {"num_cpus": 1, "num_gpus": SHARED_GPU}
    if role == "trainer":
        return {"num_cpus": 1, "num_gpus": 1}
    return {"num_cpus": 2, "num_gpus": config.rollout.tensor_parallel_size}


def spawn(cls: type, config: RecipeConfig, role: str, *args: Any):
    """Start actor `cls` with the placement of `role` (trainer, engine, reward)."""
    return ray.remote(**_options(config, role))(cls).remote(config, *args)
