"""The scaled-out loop end to end on the tiny MoE through the real `moe-rl train` (Ray): a trainer
group of several rank actors, a pool of engine replicas, batches sharded by reference and weights
streamed in buckets.

* DP=2's first step equals the one-rank run's (the in-process loop, which reproduces a one-rank
  Ray run exactly): loss, grad norm and the updated weights.
* DP=2 with two engines learns like the one-rank run, while one replica crashes inside a generate
  (fault injection): it is restarted with the current weights, only its prompts are generated
  again, every step logs the group's size, the engines, the sync and the tokens per engine.
* A PP=2 group trains LoRA adapters with R3 and keep-sampling-mask; each stage sends its own (the
  EP=2 group: tests/e2e/test_multi_node.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.runs import TINY, check_parallel_steps, train_tiny

pytestmark = pytest.mark.e2e


def _model_weights(checkpoint: Path, config) -> dict[str, torch.Tensor]:
    """The model tensors of a trainer checkpoint (any world size), loaded into a one-rank model."""
    from megatron.core import dist_checkpointing

    from moe_rl.megatron.model import build_gpt_model
    from moe_rl.megatron.parallel import init_parallel

    init_parallel(config.parallel)
    model = build_gpt_model(config.model, config.parallel, config.trainer, seed=99)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(checkpoint))
    model.load_state_dict(state["model"])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_dp2_first_step_equals_the_one_rank_run(tmp_path):
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked

    # Adam's epsilon at 1e-6 instead of 1e-8: with 1e-8, a weight whose first mini-batch gradient
    # cancels to ~2e-8 (one qkv element of this run, against a median |g| of 1e-3) moves by an
    # amount its gradient's last bits decide (2e-5 apart between the two summation orders); the
    # gradients themselves agree (tests/distributed/test_trainer_dp.py), and so does every weight
    # once no gradient sits at epsilon.
    same = ["run.steps=1", "trainer.adam_eps=1e-6"]
    config = load_checked(TINY, same)
    local = LocalRun(config)
    start = {n: p.detach().clone() for n, p in local.trainer.model.named_parameters()}
    reference = local.step(0)
    records = train_tiny(tmp_path, "dp2", *same, "parallel.trainer_world_size=2")
    (step,) = records
    assert step["trainer/world_size"] == 2 and step["rollout/engines"] == 1
    assert step["reward/mean"] == reference["reward/mean"]  # same weights, same seed: same rollouts
    for key in ("train/loss", "train/grad_norm", "train/denominator"):  # global sums and norms
        assert step[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-9), key
    # diagnostics are means of per-micro-batch means: the packing differs, the quantity does not
    assert step["old/kl_k3"] == pytest.approx(reference["old/kl_k3"], rel=1e-2)
    weights = _model_weights(tmp_path / "dp2" / "checkpoints" / "step_000000" / "trainer", config)
    moved = 0.0
    for name, param in local.trainer.model.named_parameters():
        # one Adam step of lr 5e-3: a gradient that differs in its last bits moves a weight by ~1e-6
        torch.testing.assert_close(
            weights[name], param.detach(), atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
        moved = max(moved, float((param.detach() - start[name]).abs().max()))
    assert moved > 1e-3  # the step did update the weights


def test_dp2_with_two_engines_learns_through_a_replica_crash(tmp_path):
    records = train_tiny(
        tmp_path, "pool", "run.steps=20", "parallel.trainer_world_size=2", "rollout.num_engines=2",
        env={"MOE_RL_FAULTS": "die_in_generate=1@3"},  # replica 1 exits inside its third generate
    )  # fmt: skip
    assert [r["step"] for r in records] == list(range(20))
    first = sum(r["reward/mean"] for r in records[:5]) / 5
    last = sum(r["reward/mean"] for r in records[-5:]) / 5
    assert last > first + 0.15, f"reward did not rise: first five {first:.3f}, last five {last:.3f}"
    crashed = records[2]
    prompts = 64 // 8
    assert 0 < crashed["rollout/regenerated_prompts"] < prompts  # only the dead replica's prompts
    assert sum(r["rollout/regenerated_prompts"] for r in records) == crashed["rollout/regenerated_prompts"]
    assert records[1]["rollout/engine_restarts"] == 0 and records[-1]["rollout/engine_restarts"] == 1
    for r in records:
        assert (r["trainer/world_size"], r["rollout/engines"]) == (2, 2)
        assert r["sync/bytes"] > 0 and r["sync/buckets"] >= 1 and r["time/sync_s"] > 0
        # fp8: the quantized weights are written into the slots, the rest read where the trainer holds it
        assert r["sync/shared_memory"] == 1 and 0 < r["sync/in_place_bytes"] < r["sync/bytes"]
        assert r["rollout/tokens_engine0"] > 0 and r["rollout/tokens_engine1"] > 0
        assert r["quant/recipe"] == "fp8_block128" and r["quant/rel_err"] > 0


LORA_ADAPTERS = ["lora.rank=8", "lora.train_output_layer=true", "lora.sync=adapters"]
"""The pipeline case trains LoRA adapters, synced apart: each stage sends its adapters (and the last
its output layer); the engines took the frozen base once, before the first step."""


def test_a_pipeline_parallel_group_trains_lora_adapters_with_r3_and_ksm(tmp_path):
    """(The expert-parallel group runs in tests/e2e/test_multi_node.py, on one node and on two.)"""
    records = train_tiny(
        tmp_path, "pp2", "run.steps=3", "parallel.trainer_world_size=2",
        "parallel.pipeline_model_parallel_size=2", *LORA_ADAPTERS,
    )  # fmt: skip
    check_parallel_steps(records, adapters_only=True)
