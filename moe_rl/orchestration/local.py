"""The RL loop in one process, without Ray: one trainer rank and the Megatron engine side by side.

For machines without Ray (the GPU check runs RL steps this way) and for tests that need the
one-rank run as a reference. It drives the same pieces as the Ray run — `TrainerWorker`, the
`MegatronEngine`, the reward scorer, `batches.prepare` / `step_spec` / `step_advantages`, and the
bucket weight sync of `moe_rl.weight_sync` — step by step; on CPU it reproduces the Ray run of the
same recipe with one rank and one engine exactly. Trainer layouts other than one whole-model rank
need the Ray trainer group.

    python -m moe_rl.orchestration.local RECIPE [overrides...]   # prints one JSON line per step
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator

from moe_rl.config.modes import Engine
from moe_rl.config.schema import RecipeConfig

log = logging.getLogger("moe_rl.local")


class LocalRun:
    """Trainer, engine, scorer and prompt stream of one process (see the module docstring)."""

    def __init__(self, config: RecipeConfig):
        from moe_rl.envs.rollout import rollouts_for
        from moe_rl.orchestration.batches import step_scorer
        from moe_rl.rewards.registry import build_prompt_source
        from moe_rl.rollout.megatron_engine import MegatronEngine
        from moe_rl.trainer.worker import TrainerWorker
        from moe_rl.weight_sync.buckets import BucketPacker

        if config.parallel.trainer_world_size != 1 or config.rollout.engine != Engine.MEGATRON:
            raise ValueError(
                f"the in-process loop runs one trainer rank and the Megatron engine; got "
                f"parallel.trainer_world_size={config.parallel.trainer_world_size}, "
                f"rollout.engine={config.rollout.engine} (use `moe-rl train`, on Ray)"
            )
        self.config = config
        self.trainer = TrainerWorker(config)
        self.engine = MegatronEngine(config)
        self.rollouts = rollouts_for(config, self.engine)
        self.scorer = step_scorer(config)
        self.source = build_prompt_source(config)
        self.version = 0
        self.packer = BucketPacker(config.rollout.sync_bucket_mb << 20)
        self.sync(0)

    def sync(self, version: int) -> dict[str, float]:
        """The trainer's weights into the engine, bucket by bucket, quantized per recipe."""
        from moe_rl.weight_sync.sender import stream_buckets
        from moe_rl.weight_sync.wire import WireEncoder

        cfg = self.config
        start = time.perf_counter()
        encoder = WireEncoder(cfg.quant, cfg.model.num_layers, self.engine.capabilities.quantized_wire)
        self.engine.begin_weight_update(version)
        sent = buckets = 0
        for bucket in stream_buckets(self.trainer.model, encoder, self.packer.capacity, packer=self.packer):
            self.engine.receive_bucket(bucket)
            sent, buckets = sent + bucket.nbytes, buckets + 1
        out = self.engine.finish_weight_update(version)
        if encoder.active:
            out.update(encoder.report.summary())
        self.version = version
        return {
            **out,
            "sync/bytes": sent,
            "sync/buckets": buckets,
            "sync/seconds": time.perf_counter() - start,
        }

    def step(self, step: int) -> dict[str, float]:
        """generate → reward → advantages → old log-probs → train → sync."""
        from moe_rl.envs.rollout import env_metrics
        from moe_rl.orchestration.batches import (
            length_metrics,
            prepare,
            rank_parts,
            step_advantages,
            step_rewards,
            step_spec,
            step_zero_variance,
        )
        from moe_rl.trainer.batch import TrainerBatch

        cfg, t0 = self.config, time.perf_counter()
        prompts = self.source.next_batch(cfg.rollout.batch_size // cfg.rollout.group_size)
        group_ids = [step * len(prompts) + i for i in range(len(prompts))]
        batch, env = self.rollouts.generate(prompts, step_spec(cfg, step), group_ids)
        rewards = step_rewards(self.scorer, batch, prompts, cfg.rollout.group_size)
        batch, summary = prepare(
            batch, rewards, self.version, cfg.run.max_staleness, vocab_size=cfg.model.vocab_size, dp_size=1,
            max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch,
            num_mini_batches=cfg.trainer.num_mini_batches,
        )  # fmt: skip
        advantages, metrics = step_advantages(cfg, summary.rewards, summary.group_ids)
        metrics.update(length_metrics(batch))
        metrics.update(env_metrics([env]))
        metrics["reward/mean"] = float(summary.rewards.mean())
        signs = step_zero_variance(cfg, summary.rewards, summary.group_ids)
        (part,) = rank_parts(summary.plan, [batch], advantages, signs)
        prepared = self.trainer.old_logp(
            TrainerBatch.of_share(part.trajectories, part.advantages, part.share, part.zvp_signs)
        )
        metrics.update(prepared.metrics)
        metrics.update(self.trainer.train(prepared))
        metrics.update(self.sync(step + 1))
        metrics["time/step_s"] = time.perf_counter() - t0
        return {"step": step, **metrics}

    def run(self, steps: int | None = None) -> Iterator[dict[str, float]]:
        for step in range(self.config.run.steps if steps is None else steps):
            yield self.step(step)


def main(argv: list[str] | None = None) -> int:
    from moe_rl.log import setup_logging
    from moe_rl.orchestration.preflight import load_checked

    args = sys.argv[1:] if argv is None else argv
    if not args:
        sys.stderr.write("usage: python -m moe_rl.orchestration.local RECIPE [overrides...]\n")
        return 2
    config = load_checked(args[0], args[1:])
    setup_logging(config.logging.level)
    for record in LocalRun(config).run():
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
