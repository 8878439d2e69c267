"""What a recipe costs in one value (`moe_rl.planner.estimate`): the sync plan of the machine the
recipe describes (`moe_rl.config.derived.target_device`, the preflight's machine too), a step time
or the one line why there is none, and ``moe-rl plan`` showing exactly that estimate."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from launch.plan import make_plan
from moe_rl.config import load_recipe
from moe_rl.config.derived import target_device
from moe_rl.config.sync_plan import sync_plan
from moe_rl.orchestration.preflight import target_machine
from moe_rl.planner.estimate import estimate, recipe_sync_plan
from moe_rl.planner.flops import count_params
from moe_rl.planner.memory import rollout_memory, trainer_memory

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "recipes"


@pytest.mark.parametrize(
    ("recipe", "overrides", "meant"),
    [
        ("tiny_moe", [], "cpu"),
        ("qwen3_30b_a3b", [], "cuda"),  # run.device=auto on a cluster of GPUs
        ("tiny_moe", ["run.device=cuda"], "cuda"),
        ("qwen3_30b_a3b", ["run.device=cpu"], "cpu"),
        ("tiny_moe", ["cluster.gpus_per_node=8", "run.device=auto"], "cuda"),
        ("tiny_moe", ["cluster.gpus_per_node=1"], "cuda"),  # one GPU a node is a cluster of GPUs
    ],
)
def test_the_machine_a_recipe_describes_is_told_in_one_place(recipe, overrides, meant):
    config = load_recipe(RECIPES / f"{recipe}.yaml", overrides)
    assert target_device(config) == meant
    assert target_machine(config).cuda == (meant == "cuda")
    assert recipe_sync_plan(config) == sync_plan(config, meant)


def test_the_estimate_is_the_planners_parts_and_the_plan_shows_it():
    config = load_recipe(RECIPES / "qwen3_30b_a3b.yaml")
    cost = estimate(config)
    counts = count_params(config.model)
    assert cost.counts == counts
    assert cost.trainer == trainer_memory(config, counts) and cost.rollout == rollout_memory(config, counts)
    assert cost.step is not None and cost.step_unknown == "" and cost.step.seconds > 0
    plan = make_plan(config, paths=False)
    assert (plan.counts, plan.trainer, plan.rollout, plan.sync, plan.step, plan.step_unknown) == (
        cost.counts, cost.trainer, cost.rollout, cost.sync, cost.step, cost.step_unknown,
    )  # fmt: skip


def test_an_estimate_without_a_step_time_says_why_in_one_line():
    config = load_recipe(RECIPES / "qwen3_30b_a3b.yaml", ["rollout.gpu_memory_utilization=0.05"])
    cost = estimate(config)
    assert cost.step is None and cost.step_unknown.startswith("generation cannot run: the KV cache holds")
    assert "\n" not in cost.step_unknown


def test_a_refused_sync_route_leaves_no_sync_plan():
    config = load_recipe(RECIPES / "tiny_moe.yaml", ["rollout.sync_transport=vllm_nccl"])
    assert recipe_sync_plan(config) is None and estimate(config).sync is None


def test_the_step_time_bench_predicts_without_the_command_line():
    """``bench/plan_model.py`` predicts with the planner, not with ``launch``."""
    tree = ast.parse((REPO / "bench" / "plan_model.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    assert "moe_rl.planner.estimate" in imported
    assert not {name for name in imported if name and name.split(".")[0] == "launch"}
