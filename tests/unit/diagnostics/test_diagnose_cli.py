"""`moe-rl diagnose` / `report` argument handling: a bad name or value fails in about a second,
before torch or Megatron load; a recipe the engine refuses becomes "not available"."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.diagnose import parse_quants, resolve
from moe_rl.config import ConfigError
from moe_rl.diagnostics.results import NotAvailable

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
    vllm = resolve(TINY, ["rollout.engine=vllm", "run.device=cpu", "model.head_dim=32", "algo.routing_replay=off",
                          "algo.corrections.keep_sampling_mask=false"], "bf16,fp8_block128")  # fmt: skip
    assert isinstance(vllm["fp8_block128"], NotAvailable) and "vllm" in vllm["fp8_block128"].reason
    with pytest.raises(ConfigError, match="fp9"):
        resolve(TINY, [], "bf16,fp9")


@pytest.mark.parametrize(
    "args, message",
    [(["diagnose", TINY, "--quant", "fp9"], "fp9"), (["diagnose", TINY, "--prompts", "0"], "--prompts=0"),
     (["report", "/nonexistent/run"], "no metrics.jsonl")],
)  # fmt: skip
def test_bad_arguments_fail_fast_with_the_value(args, message):
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 2 and message in out.stderr
    assert "megatron" not in out.stderr.lower()
    assert time.perf_counter() - start < 20  # no torch / Megatron import (2 shared cores: generous)
