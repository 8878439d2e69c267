"""The RL loop, read as the algorithm; the driver (`moe_rl.orchestration.driver`) and the
one-process loop (`moe_rl.orchestration.local`) both run it over their `Stages`:

    generate → reward → advantages → old log-probs → train → sync weights → log / checkpoint

Modes (`run.mode`): `sync` (on-policy: each batch is generated with the weights it trains) and
`async` (one-step-off-policy: the next batch is generated while the current one trains; its
tokens are one policy version old, and batches older than `run.max_staleness` versions are
rejected and counted, never trained on); `offline` (DGO) trains epochs over stored trajectories.
Imports no Ray.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from moe_rl.config.modes import RunMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.orchestration.stages import Stages


def online_loop(config: RecipeConfig, stages: Stages, start: int, stop: int | None = None) -> Iterator[dict]:
    """Generate with the current policy (or one version behind, async), then train on it; steps
    ``start`` to ``stop`` (default `run.steps`)."""
    stop = config.run.steps if stop is None else stop
    pending = stages.launch_rollout(start) if config.run.mode == RunMode.ASYNC else None
    for step in range(start, stop):
        t0 = time.perf_counter()
        batch, metrics = stages.rollout(step, pending)  # generate on the engine pool (+ staleness)
        batch = stages.reward(batch, metrics)  # verifiable rewards (scored by the reward worker)
        stages.dump(step, batch)  # optional trajectory shards
        advantages = stages.advantages(batch, metrics)  # GRPO / Dr.GRPO / RLOO
        prepared = stages.old_logp(batch, advantages, metrics)  # π_old + mismatch diagnostics
        if config.run.mode == RunMode.ASYNC and step + 1 < stop:
            pending = stages.launch_rollout(step + 1)  # overlaps training
        stages.train(prepared, metrics)  # objective + corrections
        stages.sync_weights(version=step + 1, metrics=metrics)  # quantized per recipe
        metrics["time/step_s"] = time.perf_counter() - t0
        stages.maybe_probe(step, metrics)  # optional mismatch probe
        yield {"step": step, **metrics}


def offline_loop(config: RecipeConfig, stages: Stages, start: int) -> Iterator[dict]:
    """DGO: generation decoupled from optimization; epochs over stored trajectories (or, for
    `moe-rl sft`, over demonstrations, each of weight 1: maximum likelihood)."""
    dataset = stages.offline_dataset()  # stored, or generated once
    for step in range(start, config.run.steps):
        t0 = time.perf_counter()
        batch, metrics = stages.offline_batch(dataset, step)
        weights = stages.advantages(batch, metrics)  # exp(r/β) / mean_group exp(r/β)
        prepared = stages.old_logp(batch, weights, metrics)  # drift from the sampling policy
        stages.train(prepared, metrics)  # −w·log π(y|x)
        stages.sync_weights(version=step + 1, metrics=metrics)
        stages.evaluate(step, metrics)  # fresh rollouts: reward/mean
        metrics["time/step_s"] = time.perf_counter() - t0
        if config.sft.demonstrations is not None:  # no sampling policy to compare the trainer with
            metrics = {k: v for k, v in metrics.items() if not k.startswith(("old/", "offline/reward"))}
        yield {"step": step, **metrics}
