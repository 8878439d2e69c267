"""`moe-rl diagnose` / `report` argument handling: a bad name or value fails in about a second,
before torch or Megatron load; a recipe the engine refuses becomes "not available"; recipes are
checked against the machine diagnose runs on, detected only when a rule needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.diagnose import parse_quants, resolve
from moe_rl.config import ConfigError
from moe_rl.diagnostics.results import NotAvailable
from tests.cli_testing import run_cli

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "recipes" / "tiny_moe.yaml")


def test_parse_quants():
    assert parse_quants(None, "fp8_block128") == ["fp8_block128"]
    assert parse_quants(" bf16, int8,bf16 ", "x") == ["bf16", "int8"]
    with pytest.raises(ConfigError, match="--quant=','"):
        parse_quants(",", "x")


def test_resolve_overrides_the_quant_last_and_reports_refusals():
    configs = resolve(TINY, ["rollout.quant=int8"], "bf16,fp8_block128")
    assert [c.quant.name for c in configs.values()] == ["bf16", "fp8_block128"]
    assert configs["fp8_block128"].quant.granularity == "block"
    vllm = resolve(TINY, ["rollout.engine=vllm", "run.device=cpu", "rollout.max_model_len=128", "model.head_dim=32",
                          "algo.routing_replay=off", "algo.corrections.keep_sampling_mask=false"],
                   "bf16,fp8_block128")  # fmt: skip
    assert isinstance(vllm["fp8_block128"], NotAvailable) and "vllm" in vllm["fp8_block128"].reason
    with pytest.raises(ConfigError, match="fp9"):
        resolve(TINY, [], "bf16,fp9")


@pytest.mark.parametrize(
    "args, message",
    [(["diagnose", TINY, "--quant", "fp9"], "fp9"), (["diagnose", TINY, "--prompts", "0"], "--prompts=0"),
     (["report", "/nonexistent/run"], "no metrics.jsonl")],
)  # fmt: skip
def test_bad_arguments_fail_fast_with_the_value(args, message):
    out, heavy = run_cli(*args)
    assert out.returncode == 2 and message in out.stderr
    assert "megatron" not in out.stderr.lower()
    assert not heavy & {"megatron", "ray", "vllm"}, heavy  # refused before the model or Ray


def test_recipes_are_checked_against_the_machine_given():
    """`diagnose` checks the recipes against the machine it runs on: the tiny recipe
    (run.device=auto, no GPUs in its cluster section) may use nvfp4 on a GPU machine."""
    from moe_rl.device import Machine

    on_cpu = resolve(TINY, [], "bf16,nvfp4")  # the machine the recipe describes: no GPU
    assert isinstance(on_cpu["nvfp4"], NotAvailable) and "CUDA" in on_cpu["nvfp4"].reason
    asked = []

    def gpu_machine() -> Machine:
        asked.append(1)
        return Machine(cuda=True, capability=(9, 0))

    on_gpu = resolve(TINY, [], "bf16,nvfp4", gpu_machine)
    assert not isinstance(on_gpu["nvfp4"], NotAvailable) and on_gpu["nvfp4"].quant.name == "nvfp4"
    assert asked  # detected when a rule needed it


def test_a_recipe_refused_for_itself_never_detects_the_machine():
    from moe_rl.config import load_recipe
    from moe_rl.orchestration.preflight import check

    config = load_recipe(TINY, ["rollout.group_size=7"])

    def no_detection():
        raise AssertionError("the machine was detected for a recipe refused for its own values")

    with pytest.raises(ConfigError, match="group_size"):
        check(config, no_detection)
