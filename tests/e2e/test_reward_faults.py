"""A reward function that hangs, through the real `moe-rl train` on the tiny recipe (Ray actors: the
reward worker scores in an actor of its own): with a 2-second `data.reward_timeout_s` the run stops
with one line naming the function, the prompt and the cause, or (`data.reward_on_failure=zero`)
goes on and counts `reward/failed`; without a limit, a Ctrl-C while it hangs ends the run within
seconds, saying what it waited for.

The zero-scoring run is also the installed `moe-rl` command (not `python -m`, which puts the working
directory on the path itself) run from the folder that holds the reward module, with no
PYTHONPATH: the preflight imports it in the driver and the Ray reward worker calls it for every
response (each call records its process). Before, the command refused it: "cannot import
hang_reward: No module named 'hang_reward'"."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = "recipes/tiny_moe.yaml"
HANG = """
import os, pathlib, time
def score(response, answer):
    here = pathlib.Path(__file__)
    here.with_name("scoring").touch()  # the test waits for it
    with open(here.with_name("calls.txt"), "a") as calls:
        calls.write(f"{os.getpid()}\\n")
    time.sleep(3600)
"""
DEADLINE_S = 600.0


def _train(tmp_path: Path, name: str, *overrides: str, from_its_folder: bool = False) -> subprocess.Popen:
    """`moe-rl train` of the tiny recipe on a text dataset, scored by a user function that hangs:
    `python -m` from the repository with the module's folder on PYTHONPATH, or (``from_its_folder``)
    the installed command run from the module's folder with no PYTHONPATH."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    (tmp_path / "hang_reward.py").write_text(HANG)
    args = ["train", str(REPO / TINY), f"run.name={name}", f"run.output_dir={tmp_path}", "logging.progress=false",
            "logging.tensorboard=false", f"data.task=file:{data}", "data.reward=hang_reward:score",
            "model.vocab_size=320", "rollout.batch_size=16", *overrides]  # fmt: skip
    if from_its_folder:
        command = Path(sys.executable).parent / "moe-rl"
        assert command.is_file(), f"{command}: the package's console script is not installed"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the working directory alone
        cmd, cwd = [str(command), *args], tmp_path
    else:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
        cmd, cwd = [sys.executable, "-m", "launch.cli", *args], REPO
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if " E moe_rl" in line or " E launch" in line]


def test_a_hung_reward_past_its_timeout_stops_the_run_with_one_line(tmp_path):
    proc = _train(tmp_path, "hung", "run.steps=2", "data.reward_timeout_s=2", "data.reward_workers=4")
    out, _ = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    (line,) = _errors(out)
    assert re.search(
        r"reward function data.reward=hang_reward:score did not return within data.reward_timeout_s=2.0 s "
        r"\(prompt \d, response .*, answer '\d'\) \(traceback: .*train.log\)$",
        line,
    ), line


def test_a_hung_reward_scored_zero_is_counted_and_its_time_on_the_step_line(tmp_path):
    """Also: the reward module is found in the folder the command runs from (module docstring)."""
    proc = _train(
        tmp_path, "zero", "run.steps=2", "data.reward_timeout_s=2", "data.reward_workers=16",
        "data.reward_on_failure=zero", from_its_folder=True,
    )  # fmt: skip
    out, _ = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0, out[-3000:]
    callers = (tmp_path / "calls.txt").read_text().split()
    assert len(callers) == 2 * 16  # every response of both steps (rollout.batch_size=16)
    assert str(proc.pid) not in callers  # called by the reward worker, not the driver
    records = [json.loads(line) for line in (tmp_path / "zero" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/failed"] for r in records] == [16, 16] and [r["reward/mean"] for r in records] == [0, 0]
    assert "16 of 16 responses scored 0, their reward call failed (data.reward_on_failure=zero)" in out
    steps = [line for line in out.splitlines() if "moe_rl.metrics: step " in line]
    assert len(steps) == 2, steps
    for line, record in zip(steps, records):  # the scoring's time when it is the step's longest stage
        stages = {k: v for k, v in record.items() if k.startswith("time/") and k != "time/step_s"}
        longest = max(stages, key=stages.get) == "time/reward_s"
        shown = re.search(
            rf"\| scoring {record['time/reward_s']:.1f}s \| {record['time/step_s']:.1f}s$", line
        )
        assert bool(shown) == longest and record["time/reward_s"] >= 2.0, (line, stages)


def test_ctrl_c_while_a_reward_hangs_stops_within_seconds_saying_what_it_waited_for(tmp_path):
    proc = _train(tmp_path, "ctrlc", "run.steps=2", "data.reward_timeout_s=null")
    marker, deadline = tmp_path / "scoring", time.monotonic() + DEADLINE_S
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the run never started scoring"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)  # generous: the run gives up waiting a few seconds after
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert re.search(
        r"W moe_rl.driver: stopped while waiting for the reward worker to score 16 responses of step 0 "
        r"\(data.reward=hang_reward:score\), for \d+ s: no checkpoint of this step; --resume starts from "
        r"the last one$",
        out,
        re.MULTILINE,
    ), out[-3000:]
