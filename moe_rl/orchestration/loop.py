"""The RL loop, read as the algorithm; the driver (`moe_rl.orchestration.driver`) and the
one-process loop (`moe_rl.orchestration.local`) both run it over their `Stages`:

    generate → reward → advantages → old log-probs → train → sync weights → log / checkpoint

Modes (`run.mode`): `sync` (on-policy: each batch is generated with the weights it trains) and
`async` (off-policy: the batches of the next `run.async_depth` steps are generated while the
current one trains, so a batch's tokens are `async_depth` policy versions old, and batches older
than `run.max_staleness` versions are rejected and counted, never trained on); `offline` (DGO)
trains epochs over stored trajectories.
Imports no Ray.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

from moe_rl.config.modes import RunMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.orchestration.stages import Stages


def online_loop(config: RecipeConfig, stages: Stages, start: int, stop: int | None = None) -> Iterator[dict]:
    """Generate with the current policy (or `run.async_depth` versions behind, async), then train
    on it; steps ``start`` to ``stop`` (default `run.steps`)."""
    stop = config.run.steps if stop is None else stop
    ahead = config.run.async_depth if config.run.mode == RunMode.ASYNC else 0
    pending = deque(stages.launch_rollout(s) for s in range(start, min(start + ahead, stop)))
    for step in range(start, stop):
        t0 = time.perf_counter()
        batch, metrics = stages.rollout(step, pending.popleft() if pending else None)  # (+ staleness)
        batch = stages.reward(batch, metrics)  # verifiable rewards (scored by the reward worker)
        stages.dump(step, batch)  # optional trajectory shards
        advantages = stages.advantages(batch, metrics)  # GRPO / Dr.GRPO / RLOO
        prepared = stages.old_logp(batch, advantages, metrics)  # π_old + mismatch diagnostics
        if ahead and step + ahead < stop:
            pending.append(stages.launch_rollout(step + ahead))  # overlaps training
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
