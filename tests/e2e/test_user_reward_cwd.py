"""A user's reward module in the folder `moe-rl train` runs from is found: the installed `moe-rl`
command (not `python -m`, which puts the working directory on the path itself) trains the tiny
recipe for two steps on a prompt file, scored by ``my_reward:score`` from that folder. The
preflight imports it in the driver and the Ray reward worker scores every response with it (each
call records its process). Before, the command refused it: "cannot import my_reward: No module
named 'my_reward'"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny_moe.yaml"
REWARD = """\
import os
from pathlib import Path

def score(response, answer):
    with open(Path(__file__).parent / "calls.txt", "a") as calls:
        calls.write(f"{os.getpid()}\\n")
    return float(answer in response)
"""


def test_moe_rl_train_finds_a_reward_module_in_the_working_directory(tmp_path):
    command = Path(sys.executable).parent / "moe-rl"
    assert command.is_file(), f"{command}: the package's console script is not installed"
    (tmp_path / "my_reward.py").write_text(REWARD)
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(16)]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["train", str(TINY), "data.task=file:qa.jsonl", "data.reward=my_reward:score", "model.vocab_size=320",
            "run.steps=2", "run.name=cwd", "run.output_dir=runs", "logging.progress=false",
            "logging.tensorboard=false"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the working directory alone
    process = subprocess.Popen([str(command), *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=900)
    finally:
        process.kill()  # past the deadline (no-op once it has exited)
    assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    records = [
        json.loads(line) for line in (tmp_path / "runs" / "cwd" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [0, 1]
    callers = (tmp_path / "calls.txt").read_text().split()
    assert len(callers) == 2 * 64  # every response of both steps (rollout.batch_size=64)
    assert str(process.pid) not in callers  # scored by the reward worker, not the driver
