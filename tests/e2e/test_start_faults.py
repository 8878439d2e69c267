"""A run's start under faults, through the real `moe-rl train`: a Ctrl-C during the preflight, while
Ray starts and while the workers start (one line, no half-made run directory, no Ray process left),
a resume whose recipe changes the model's shape (one line naming the tensors), and a resume after a
full disk cut the only checkpoint short (it starts from step 0, as the error promised, with its log
file on a full device saying so once).

Each phase is reached by a wait the run cannot pass on its own, never by timing: the preflight
imports a reward module that reads a named pipe, Ray calls its runtime-env hook (`RAY_RUNTIME_ENV_HOOK`)
that reads one, the trainer rank logs into one; the test interrupts once the run is at it."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.e2e.runs import LEARN_STEPS, own_ray_env

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TINY = "recipes/tiny_moe.yaml"
DEADLINE_S = 300


def _ignoring_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _train(args: list[str], env: dict[str, str] | None = None, own_ray: bool = False) -> subprocess.Popen:
    """`moe-rl train` in a session of its own (a terminal's Ctrl-C reaches the whole group); with
    ``own_ray`` it starts a Ray cluster of its own, as the README's command does. It starts with
    SIGINT ignored, as a script's background job does (the sbatch script's driver): Ctrl-C stops
    it all the same."""
    return subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "train", *args, "logging.progress=false"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=own_ray_env(env) if own_ray else {**os.environ, **(env or {})}, start_new_session=True,
        preexec_fn=_ignoring_ctrl_c,
    )  # fmt: skip


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=DEADLINE_S)
    return out


def _project_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if " moe_rl." in line or " launch." in line]


def _reading(fifo: Path, proc: subprocess.Popen) -> int:
    """Wait until a reader has the named pipe ``fifo`` open (a writer can open it then), and keep
    it open without writing: the reader waits in its read until the test lets it go. Returns once
    the run's process sleeps in that read, so that a Ctrl-C interrupts the read itself rather than
    the few lines of Python between the pipe's opening and its read."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as exc:
            assert exc.errno == errno.ENXIO, exc  # no reader yet
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"nothing opened {fifo} in {DEADLINE_S} s"
        time.sleep(0.1)
    where = ""
    while "pipe" not in where:  # the kernel's name of where it sleeps: pipe_read, anon_pipe_read, ...
        try:
            where = Path(f"/proc/{proc.pid}/wchan").read_text()
        except OSError:  # not shown here: the wait ends at the pipe's opening, as it did
            break
        if where in ("", "0"):  # hidden by the kernel (kptr_restrict)
            break
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"the run opened {fifo} but never waited in its read ({where})"
        time.sleep(0.02)
    return writer


def _tagged(tag: str) -> list[str]:
    """The processes started under the environment tag ``tag`` (the run and everything it started)."""
    found = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if proc.environ().get("MOE_RL_TEST_TAG") == tag:
                found.append(f"{proc.pid} {proc.name()}")
        except psutil.Error:
            pass
    return found


def _none_left(tag: str) -> None:
    deadline = time.monotonic() + 60
    while (left := _tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the interrupted run still alive after 60 s: {left}"


def _interrupted_once(proc: subprocess.Popen) -> str:
    """Ctrl-C as a terminal sends it (to the run's process group); the run's one line."""
    os.killpg(proc.pid, signal.SIGINT)
    out = _finish(proc)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    (line,) = [x for x in out.splitlines() if "interrupted" in x]
    assert " W moe_rl.cli: interrupted " in line, out[-3000:]
    return line


def test_ctrl_c_during_the_preflight_is_one_line_and_leaves_nothing(tmp_path):
    """The preflight imports the user's reward module, which here waits on a named pipe."""
    fifo = tmp_path / "answers.fifo"
    os.mkfifo(fifo)
    (tmp_path / "slow_reward.py").write_text(
        f"open({str(fifo)!r}).read()  # a slow input the module reads when imported\n"
        "def score(response, answer):\n    return 0.0\n"
    )
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    tag = uuid.uuid4().hex
    proc = _train(
        [TINY, f"run.output_dir={tmp_path / 'runs'}", "run.name=pre", f"data.task=file:{data}",
         "data.reward=slow_reward:score", "model.vocab_size=320"],
        env={"PYTHONPATH": str(tmp_path), "MOE_RL_TEST_TAG": tag},
    )  # fmt: skip
    writer = _reading(fifo, proc)
    try:
        line = _interrupted_once(proc)
    finally:
        os.close(writer)
    assert "during the preflight" in line and "nothing was started or written" in line, line
    assert not (tmp_path / "runs").exists()
    _none_left(tag)


def test_ctrl_c_while_ray_starts_removes_the_new_run_directory(tmp_path):
    """Ray calls the runtime-env hook inside `ray.init`, after the run took its directory."""
    fifo = tmp_path / "hook.fifo"
    os.mkfifo(fifo)
    (tmp_path / "slow_ray_hook.py").write_text(
        "import os\n"
        "def hook(runtime_env):\n"
        "    open(os.environ['SLOW_HOOK_FIFO']).read()\n"
        "    return runtime_env\n"
    )
    tag = uuid.uuid4().hex
    env = {"PYTHONPATH": str(tmp_path), "RAY_RUNTIME_ENV_HOOK": "slow_ray_hook.hook",
           "SLOW_HOOK_FIFO": str(fifo), "MOE_RL_TEST_TAG": tag}  # fmt: skip
    proc = _train([TINY, f"run.output_dir={tmp_path / 'runs'}", "run.name=ray"], env=env, own_ray=True)
    writer = _reading(fifo, proc)
    assert (tmp_path / "runs" / "ray" / "config.yaml").is_file()  # the run had begun
    try:
        line = _interrupted_once(proc)
    finally:
        os.close(writer)
    assert "while the run started (Ray, its workers), before its first step" in line, line
    assert f"removed the run directory {tmp_path / 'runs' / 'ray'}" in line, line
    assert not (tmp_path / "runs" / "ray").exists()
    _none_left(tag)


def test_ctrl_c_while_the_workers_start_stops_ray_and_leaves_no_run(tmp_path):
    """The trainer rank's first log message waits on a named pipe in place of its log file, so the
    run waits for its trainer group with Ray's processes and its actors running."""
    run = tmp_path / "runs" / "workers"
    (run / "logs").mkdir(parents=True)
    os.mkfifo(run / "logs" / "trainer0.log")  # no reader: the rank waits to open it
    tag = uuid.uuid4().hex
    proc = _train(
        [TINY, f"run.output_dir={tmp_path / 'runs'}", "run.name=workers"],
        {"MOE_RL_TEST_TAG": tag},
        own_ray=True,
    )
    deadline = time.monotonic() + DEADLINE_S
    seen = ""
    while "placement on" not in seen:  # the driver is building the workers
        seen = proc.stdout.readline()
        assert seen or proc.poll() is None, "the run ended before it placed its workers"
        assert time.monotonic() < deadline
    running = _tagged(tag)
    assert any("raylet" in p for p in running) and any("gcs_server" in p for p in running), running
    line = _interrupted_once(proc)
    assert "before its first step" in line and f"nothing of the run is left in {run}" in line, line
    assert sorted(p.name for p in run.iterdir()) == ["logs", "run.lock"]  # the folder was there before
    _none_left(tag)


@pytest.fixture
def saved_run(learned_run) -> Path:
    """A finished tiny run (`learned_run`, which these tests copy): its checkpoint of the last step
    sealed, the only one."""
    return learned_run.path


LAST = f"step_{LEARN_STEPS - 1:06d}"
"""The saved run's checkpoint."""


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, symlinks=True)
    return to


def test_resume_with_a_changed_model_shape_is_one_line_naming_the_tensors(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path / "run")
    metrics = (run / "metrics.jsonl").read_bytes()
    proc = _train(
        [TINY, "--resume", str(run), f"run.steps={LEARN_STEPS + 2}", "model.moe_ffn_hidden_size=48"]
    )
    out = _finish(proc)
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    (line,) = [x for x in out.splitlines() if " E " in x]
    assert " E moe_rl.cli: checkpoint " in line and "does not fit the model of the resumed run" in line
    assert (
        "4 tensors of another shape, e.g. decoder.layers.0.mlp.experts.experts.linear_fc1.weight: "
        "(8, 128, 64) in the checkpoint, (8, 96, 64) in the model" in line
    ), line
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing rewritten
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")] == [LAST]


def test_a_resume_after_a_full_disk_cut_the_only_checkpoint_starts_from_step_0(saved_run, tmp_path):
    """What a full disk leaves: the checkpoint's largest file cut short, no manifest. The error
    promised that a resume skips it; it does, from step 0 (none older), setting it aside. The run's
    log file is on a full device (/dev/full): said once, no "--- Logging error ---"."""
    run = _copy(saved_run, tmp_path / "run")
    cut = run / "checkpoints" / LAST
    (cut / "manifest.json").unlink()
    largest = max((p for p in cut.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:4096])
    (run / "logs" / "train.log").unlink()
    (run / "logs" / "train.log").symlink_to("/dev/full")
    proc = _train([TINY, "--resume", str(run), "run.steps=2"])
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "Logging error" not in out and "Traceback" not in out, out[-3000:]
    assert f"checkpoint {LAST} is not usable (no manifest.json (the save did not finish)); " in out
    assert "no checkpoint yet; starting from step 0" in out
    (full,) = [x for x in out.splitlines() if "train.log: no space left on the device" in x]
    assert " W moe_rl.log: " in full
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names[:2] == ["latest", "step_000001"] and names[2].startswith(f"{LAST}.unusable-"), names
    assert (run / "checkpoints" / "step_000001" / "manifest.json").is_file()
