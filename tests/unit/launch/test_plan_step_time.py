"""`moe-rl plan`'s step time: the phase table between the weight sync and the constraints, the
colocated step's released bytes, `--sweep` (one row per value, the nodes and engines following the
rollout's nodes) and the bad inputs (an unknown chip, a KV cache that holds no sequence, a
malformed sweep) said in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.plan import make_plan, sweep_overrides
from moe_rl.config import load_recipe
from moe_rl.planner.memory import released_bytes

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "recipes"


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.cli", "plan", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def _plan(recipe: str, *overrides: str):
    return make_plan(load_recipe(RECIPES / f"{recipe}.yaml", list(overrides)), paths=False)


def test_the_plan_prints_the_phases_between_the_sync_and_the_constraints():
    out = _cli("recipes/qwen3_30b_a3b.yaml", "--skip-path-checks")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.index("Weight sync") < text.index("Step time (h100") < text.index("Constraints")
    section = text[text.index("Step time (h100") : text.index("Constraints")]
    for phase in ("prefill", "decode", "π_old", "training", "weight sync", "step"):
        assert re.search(rf"│ {re.escape(phase)}\s+│", section), (phase, section)
    assert "reference" not in section  # algo.kl.coef=0: no reference pass
    plan = _plan("qwen3_30b_a3b")
    assert f"{plan.step.seconds:,.1f} s" in section
    shares = [int(s) for s in re.findall(r"│\s+(\d+)% │", section)]
    assert len(shares) == 5 and 98 <= sum(shares) <= 102


def test_a_colocated_step_releases_gradients_and_optimizer_and_offloads_them():
    plan = _plan(
        "qwen3_30b_a3b", "cluster.nodes=2", "cluster.trainer_nodes=2", "cluster.rollout_nodes=0",
        "rollout.num_engines=16",
    )  # fmt: skip
    t = plan.trainer
    assert released_bytes(plan.config, t) == t.grads + t.optimizer
    offload = plan.step.phase("offload")
    assert offload.seconds == pytest.approx(
        2 * (t.grads + t.optimizer + plan.rollout.weights_per_gpu) / (64e9 * plan.step.efficiency.sync)
    )
    weights_too = _plan(
        "qwen3_30b_a3b", "cluster.nodes=2", "cluster.trainer_nodes=2", "cluster.rollout_nodes=0",
        "rollout.num_engines=16", "cluster.offload_params=true",
    )  # fmt: skip
    assert released_bytes(weights_too.config, weights_too.trainer) == t.grads + t.optimizer + t.weights
    assert released_bytes(_plan("qwen3_30b_a3b").config, t) == 0.0  # on nodes of their own
    assert released_bytes(_plan("tiny_moe").config, t) == 0.0  # the CPU


def test_a_kv_cache_that_holds_no_sequence_prints_why_instead_of_a_time():
    plan = _plan("kimi_k2", "rollout.gpu_memory_utilization=0.43")
    assert plan.step is None and plan.step_unknown.startswith("generation cannot run: the KV cache holds")
    out = _cli("recipes/kimi_k2.yaml", "--skip-path-checks", "rollout.gpu_memory_utilization=0.43")
    assert out.returncode == 1
    text = " ".join(out.stdout.split())
    assert "Step time: generation cannot run: the KV cache holds" in text
    assert "Step time (" not in out.stdout


def test_an_unknown_chip_is_one_line_before_anything_runs():
    out = _cli("recipes/tiny_moe.yaml", "cluster.gpu_type=a100")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "cluster.gpu_type='a100' is not one of: auto, h100, h200, b200, gb200, cpu"
    )
    assert out.stdout == ""
    unknown_memory = _plan("deepseek_v3", "cluster.gpu_memory_gib=96")
    assert unknown_memory.step is None
    assert unknown_memory.step_unknown.endswith("set cluster.gpu_type to one of h100, h200, b200, gb200, cpu")


def test_sweep_overrides_move_engines_and_nodes_with_the_rollout_nodes():
    config = load_recipe(RECIPES / "deepseek_v3.yaml")  # 32 trainer nodes of 8, engines of TP 16
    assert sweep_overrides(config, "cluster.rollout_nodes", "4") == [
        "cluster.rollout_nodes=4", "cluster.nodes=36", "rollout.num_engines=2",
    ]  # fmt: skip
    assert sweep_overrides(config, "cluster.rollout_nodes", "0") == [
        "cluster.rollout_nodes=0", "cluster.nodes=32", "rollout.num_engines=16",
    ]  # fmt: skip
    assert sweep_overrides(config, "cluster.trainer_nodes", "16") == [
        "cluster.trainer_nodes=16", "cluster.nodes=24", "parallel.trainer_world_size=128",
    ]  # fmt: skip
    assert sweep_overrides(config, "run.async_depth", "2") == ["run.async_depth=2"]


def test_sweep_prints_one_row_per_value():
    out = _cli("recipes/deepseek_v3.yaml", "--skip-path-checks", "--sweep", "cluster.rollout_nodes=4,8,16")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if re.match(r"│ (4|8|16)\s+│", line)]
    assert len(rows) == 3
    generation = [float(re.split(r"\s*│\s*", row)[2].removesuffix(" s").replace(",", "")) for row in rows]
    assert generation[0] > generation[1] > generation[2]  # more engines, fewer samples each
    assert all(row.rstrip(" │").endswith("PASS") for row in rows)
    # the middle row is the shipped recipe: the same step as its plan
    assert f"{_plan('deepseek_v3').step.seconds:,.1f} s" in rows[1]


def test_a_sweep_value_that_breaks_a_constraint_says_which_and_fails():
    out = _cli("recipes/qwen3_30b_a3b.yaml", "--skip-path-checks", "--sweep", "rollout.batch_size=512,496")
    assert out.returncode == 1
    assert "FAIL: batch % (mini-batches*DP)" in out.stdout


@pytest.mark.parametrize("bad", ["cluster.rollout_nodes", "rollout_nodes=4,8", "cluster.rollout_nodes=4,,8"])
def test_a_malformed_sweep_is_refused_by_the_parser(bad):
    out = _cli("recipes/tiny_moe.yaml", "--sweep", bad)
    assert out.returncode == 2
    assert "expected section.key=V1,V2,..." in out.stderr


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_model", REPO / "bench" / "plan_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["plan_model"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_shipped_factors_are_the_fit_of_the_calibration_run():
    """`FITTED` is what `bench/plan_model.py --fit` gives (three significant digits), and the fit
    reproduces its three figures: the on-policy step, the one-step-off step and the refit."""
    from moe_rl.planner.step_time import FITTED

    bench = _bench()
    fitted = bench.fit()
    assert bench.rounded(fitted) == FITTED
    c = bench.CALIBRATIONS[bench.SHIPPED]
    for label in (c.serial, c.overlapped):
        run = next(r for r in bench.STEPS if r.label == label)
        assert bench.predict(run, fitted).seconds == pytest.approx(run.seconds, rel=1e-6)
    refit = next(r for r in bench.REFITS if r.label == c.refit)
    assert bench.predict_refit(refit, fitted) == pytest.approx(refit.seconds, rel=1e-6)


def test_the_document_states_its_command_and_the_shipped_factors():
    from moe_rl.planner.step_time import FITTED

    text = (REPO / "docs" / "plan_model.md").read_text()
    assert ".venv/bin/python bench/plan_model.py --write docs/plan_model.md" in text
    assert f"| η_gen | {FITTED.generation:.3g} |" in text
    assert f"| training MFU | {FITTED.train_mfu:.3g} |" in text
    assert f"| η_sync | {FITTED.sync:.3g} |" in text


def test_the_chip_a_missed_run_would_need_is_found_and_the_table_left_as_it_was():
    """`bench/plan_model.py`'s `chip_scale_within`: the scale of the run's chip (FLOP/s and memory
    bandwidth together, `scaled_chip`) at which the model's step is half the published one; 1.0 for
    a run already within; the chip table as it was."""
    from moe_rl.config.modes import GpuType
    from moe_rl.planner.step_time import FITTED, MACHINES

    bench = _bench()
    runs = {r.label: r for r in bench.STEPS}
    gb200 = MACHINES[GpuType.GB200]
    missed = runs["Qwen3-30B-A3B, 8+8 GB200, 1-step off"]
    assert bench.predict(missed, FITTED).seconds < 0.5 * missed.seconds
    scale = bench.chip_scale_within(missed, FITTED)
    assert MACHINES[GpuType.GB200] is gb200
    assert 0.5 < scale < 1.0
    chip = bench.scaled_chip(GpuType.GB200, scale)
    assert chip.bf16_tflops == pytest.approx(gb200.bf16_tflops * scale)
    assert chip.memory_gbps == pytest.approx(gb200.memory_gbps * scale)
    assert chip.network_gbps == gb200.network_gbps
    assert bench.predict(missed, FITTED, chip).seconds == pytest.approx(0.5 * missed.seconds, rel=1e-6)
    faster = bench.scaled_chip(GpuType.GB200, scale * 1.001)  # a hair faster: too fast again
    assert bench.predict(missed, FITTED, faster).seconds < 0.5 * missed.seconds
    assert MACHINES[GpuType.GB200] is gb200
    assert bench.chip_scale_within(runs["Qwen3-235B, 64 GB200, on-policy"], FITTED) == 1.0
