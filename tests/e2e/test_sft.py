"""`moe-rl sft` on the tool task, then `moe-rl train --init-from` the SFT run: the demonstrations
(the calculator's call, then the result as the answer) teach the random model the task that RL
from scratch does not learn, and the RL run starts from the SFT run's weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOOLS = "recipes/tiny_moe_tools.yaml"


def _cli(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", *args, "logging.progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sft_teaches_the_tool_task_and_rl_starts_from_it(tmp_path):
    _cli(
        "sft",
        TOOLS,
        "run.steps=40",
        "sft.num_demonstrations=256",
        f"run.output_dir={tmp_path}",
        "run.name=sft",
    )
    sft = _records(tmp_path / "sft")
    assert [r["step"] for r in sft] == list(range(40))
    # no sampling policy to compare with, and no stored reward (SFT reads none)
    assert not any(k.startswith(("old/", "offline/reward")) for r in sft for k in r)
    # the negative log-likelihood of the demonstrations falls, the policy's own reward rises
    assert sft[-1]["train/loss"] < 0.5 * sft[0]["train/loss"]
    assert sft[0]["reward/mean"] < 0.1 and max(r["reward/mean"] for r in sft[-5:]) > 0.8
    config = (tmp_path / "sft" / "config.yaml").read_text()
    assert "mode: offline" in config and "demonstrations: env" in config and "objective: sft" in config

    _cli(
        "train", TOOLS, "--init-from", str(tmp_path / "sft"), "run.steps=2", "trainer.lr=5.0e-4",
        f"run.output_dir={tmp_path}", "run.name=rl",
    )  # fmt: skip
    logs = "".join(p.read_text() for p in (tmp_path / "rl" / "logs").glob("*.log"))  # the trainer's
    assert f"starting from the weights of {tmp_path / 'sft' / 'checkpoints' / 'step_000039'}" in logs
    first = _records(tmp_path / "rl")[0]
    assert first["reward/mean"] > 0.8  # the warm start's policy, not a random one (about 0.03)

    # `moe-rl diagnose` measures the mismatch at the same starting weights as the trainer (one rule,
    # `trainer.checkpoint.load_start_weights`): the SFT run's, not the recipe's random ones
    from moe_rl.diagnostics.zero_update import build_trainer
    from moe_rl.orchestration.preflight import load_checked

    start = build_trainer(load_checked(REPO / TOOLS, [f"model.init_from={tmp_path / 'sft'}"]))
    fresh = build_trainer(load_checked(REPO / TOOLS, []))
    differ = sum(not torch.equal(a, b) for a, b in zip(start.parameters(), fresh.parameters(), strict=True))
    assert differ > 0  # tensors that differ from the random start
