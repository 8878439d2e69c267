"""Trainer step time on the tiny CPU MoE: what R3 replay and the stability stack cost.

Three workers built from the tiny recipe (same seed, same weights, same batch), timed
interleaved in one process so machine drift hits all of them alike. One step =
``compute_old_logp`` + ``train_step`` over the rollout batch.

* ``base``:   no replay, PPO-clip, no corrections, no keep-sampling-mask, no diagnostics.
* ``r3``:     ``base`` + R3 routing replay in both passes (Megatron RouterReplay).
* ``stack``:  ``r3`` + keep-sampling-mask + IcePop + OPSM + ESPO (full-vocabulary entropy of
  π_old) + diagnostics (mismatch metrics, routing agreement).
* ``stack+``: ``stack`` as on a later mini-batch of the same rollout batch: the weights moved
  since the old-logp pass, so the update pass recomputes the routing agreement (on the first
  mini-batch it reuses the old-logp pass's, which is exact: same weights, same ids).

Printed: per-step CPU times, the paired ratios ``r3/base − 1`` (target ≤ +3 %) and
``1 − r3/stack``, the share of the step spent in corrections + KSM + ESPO + diagnostics (target
≤ 5 %), plus the stack worker's own phase timers. CPU time of this process with one torch thread
(``--threads``) is used because a shared 2-core box makes wall-clock ratios swing by ±10 %. Not
a test: numbers depend on the machine.

    python bench/trainer_step.py [--quick]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, for moe_rl

log = logging.getLogger("bench.trainer_step")

BASE = [
    "algo.routing_replay='off'",
    "algo.objective=ppo_clip",
    "algo.corrections.keep_sampling_mask=false",
    "algo.corrections.icepop.enabled=false",
    "algo.corrections.opsm.enabled=false",
    "trainer.compute_entropy=false",
]
R3 = [*BASE, "algo.routing_replay=r3"]
STACK: list[str] = []  # the tiny recipe as shipped: R3, KSM, IcePop, OPSM, ESPO


def make_batches(config, num_samples: int, seed: int):
    from moe_rl.data.synthetic import random_batch
    from moe_rl.trainer.batch import make_train_micro_batches

    model = config.model
    num_moe = model.num_layers - model.first_k_dense_layers
    batch = random_batch(
        seed,
        num_samples,
        max_prompt_len=config.data.max_prompt_len,
        max_response_len=config.rollout.max_new_tokens,
        vocab_size=model.vocab_size,
        routing=(num_moe, model.moe_router_topk, model.num_experts),
        sampling_mask=True,
    )
    advantages = torch.randn(num_samples, generator=torch.Generator().manual_seed(seed))
    return make_train_micro_batches(batch, advantages, config.trainer.max_tokens_per_microbatch)


def on_policy(worker, batches) -> None:
    """Set each batch's rollout log-probs to the worker's own (rollout = trainer, no mismatch)."""
    worker.compute_old_logp(batches)
    for mb in batches:
        mb.micro.rollout_logp = mb.old_logp.clone()


def one_step(worker, batches, later_mini_batch: bool = False) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one step."""
    wall, cpu = time.perf_counter(), time.process_time()
    worker.compute_old_logp(batches)
    if later_mini_batch:
        for mb in batches:
            mb.old_weights_version = -1
    worker.train_step(batches)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repetitions")
    parser.add_argument("--samples", type=int, default=None, help="responses per step (default: recipe)")
    parser.add_argument("--reps", type=int, default=None, help="timed steps per worker")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a busy box)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(args.threads)

    from moe_rl.config import load_recipe
    from moe_rl.trainer.worker import TrainerWorker

    recipe = ROOT / "recipes" / "tiny_moe.yaml"
    variants = (("base", BASE), ("r3", R3), ("stack", STACK), ("stack+", STACK))
    configs = {name: load_recipe(recipe, overrides) for name, overrides in variants}
    samples = args.samples or (16 if args.quick else configs["stack"].rollout.batch_size)
    reps = args.reps or (5 if args.quick else 40)
    workers = {
        name: TrainerWorker(cfg, total_steps=10_000, diagnostics=name.startswith("stack"))
        for name, cfg in configs.items()
    }
    batches = {name: make_batches(cfg, samples, seed=0) for name, cfg in configs.items()}
    for name, worker in workers.items():
        on_policy(worker, batches[name])
        one_step(worker, batches[name])  # warm-up
        worker.timer.seconds.clear()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in workers}
    order = list(workers)
    for rep in range(reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:  # rotate who goes first
            times[name].append(one_step(workers[name], batches[name], later_mini_batch=name == "stack+"))
    report(times, workers["stack"], samples, batches["stack"])


def paired(times: dict[str, list[tuple[float, float]]], name: str, ref: str) -> float:
    """Median over repetitions of the CPU-time ratio ``name / ref`` within the same repetition
    (neighbouring measurements share the machine's load, so the ratio cancels most of it)."""
    return statistics.median(a[1] / b[1] for a, b in zip(times[name], times[ref], strict=True))


def report(times: dict[str, list[tuple[float, float]]], stack, samples: int, batches) -> None:
    """Ratios of CPU time of this process (other load on the machine barely moves it)."""
    tokens = sum(mb.micro.num_tokens for mb in batches)
    print(f"tiny MoE, {samples} responses ({tokens} tokens, {len(batches)} micro-batches) per step, "
          f"{len(times['base'])} timed steps each, torch threads {torch.get_num_threads()}")  # fmt: skip
    for name in times:
        cpu = [c for _, c in times[name]]
        print(f"  {name:6s} CPU min {min(cpu) * 1e3:7.1f} ms   CPU median {statistics.median(cpu) * 1e3:7.1f} ms"
              f"   wall min {min(w for w, _ in times[name]) * 1e3:7.1f} ms")  # fmt: skip
    print(
        f"R3 replay overhead    r3/base - 1        = {paired(times, 'r3', 'base') - 1:+.2%}  (target <= +3%)"
    )
    for name in ("stack", "stack+"):
        share = 1 - 1 / paired(times, name, "r3")
        print(f"{name:6s} share          1 - r3/{name:6s}    = {share:+.2%}  (target <= 5%)")
    phases = stack.step_time_breakdown()
    total = sum(w for w, _ in times["stack"])
    print("stack worker phase timers (wall, share of its timed steps):")
    for phase, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"  {phase:12s} {seconds / total:6.1%}")


if __name__ == "__main__":
    main()
