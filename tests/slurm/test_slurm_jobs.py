"""`moe-rl submit|status|logs|cancel` against a real one-node Slurm (tests/slurm/conftest.py).

Each job goes through the real path: `moe-rl submit` renders the sbatch script, sbatch runs it,
the script starts a Ray head with srun and waits for it, then runs the driver. A stand-in driver
(`fake_driver.py`) keeps the jobs short; the last test runs the real `moe-rl train`.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
FAKE_DRIVER = Path(__file__).with_name("fake_driver.py")
SECRET = "wandb-secret-7f3a9c"  # must reach the driver's environment and no file of the run
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def moe_rl(cluster: SlurmCluster, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**cluster.env, "WANDB_API_KEY": SECRET}
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def submit(
    cluster: SlurmCluster, tmp: Path, name: str, mode: str | None, *overrides: str, driver_args: tuple = ()
) -> Path:
    """Submit the tiny recipe as run `name` (with the stand-in driver in `mode`, given
    ``driver_args``); the run dir."""
    args = ["submit", str(REPO / "recipes" / "tiny_moe.yaml"), f"run.output_dir={tmp / 'runs'}"]
    args += [
        f"run.name={name}",
        f"cluster.ray_port={ray_port()}",
        "cluster.ray_join_timeout_s=240",
        *overrides,
    ]
    args += ["--nodes", "1", "--gpus-per-node", "0", "--time", "00:20:00", "--requeue"]
    if mode is not None:
        marker = tmp / "marker.txt"
        driver = [sys.executable, str(FAKE_DRIVER), "--marker", str(marker), "--mode", mode, *driver_args]
        args += ["--command", shlex.join(driver)]
    out = moe_rl(cluster, tmp, *args)
    assert out.returncode == 0, out.stderr
    assert "submitted job" in out.stdout
    return tmp / "runs" / name


def ray_port() -> int:
    from tests.slurm.conftest import _free_port

    return _free_port()


def job_id(run_dir: Path) -> str:
    return (run_dir / "slurm_job_id").read_text().strip()


def job_fields(cluster: SlurmCluster, jid: str) -> dict[str, str]:
    out = cluster.run("scontrol", "show", "job", "-o", jid)
    return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)


def wait_for(predicate, timeout: float, what: str, run_dir: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(2)
    logs = ""
    if run_dir is not None:
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*"))
        )
    raise AssertionError(f"{what} not within {timeout:.0f} s\n{logs}")


def wait_done(cluster: SlurmCluster, run_dir: Path, timeout: float = 400) -> dict[str, str]:
    jid = job_id(run_dir)
    wait_for(lambda: job_fields(cluster, jid).get("JobState") in DONE, timeout, f"job {jid} done", run_dir)
    return job_fields(cluster, jid)


def events(tmp: Path) -> list[dict[str, str]]:
    marker = tmp / "marker.txt"
    if not marker.exists():
        return []
    return [dict(f.split("=", 1) for f in line.split("|")) for line in marker.read_text().splitlines()]


def batch_log(run_dir: Path) -> str:
    return "".join(p.read_text() for p in (run_dir / "logs").glob("*.out"))


def all_text(folder: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file())


def test_a_requeued_job_resumes_and_the_time_limit_signal_checkpoints_requeues_and_resumes(
    slurm_cluster, tmp_path
):
    """One job, restarted twice: `scontrol requeue` (restart 1) starts the driver again with
    `--resume`; then USR1, what `--signal=B:USR1@N` delivers N seconds before the time limit, makes
    the driver save a checkpoint and the job requeue itself (restart 2), which resumes and ends."""
    run_dir = submit(slurm_cluster, tmp_path, "requeue", "hold", driver_args=("--hold-until-restart", "2"))
    wait_for(lambda: events(tmp_path), 300, "the driver started", run_dir)
    jid = job_id(run_dir)
    slurm_cluster.run("scontrol", "requeue", jid)

    def resumed() -> bool:
        return any(e["event"] == "resume" and e["restarts"] == "1" for e in events(tmp_path))

    wait_for(resumed, 300, "the driver resumed after the requeue", run_dir)
    first = events(tmp_path)
    assert first[0]["event"] == "start" and first[0]["restarts"] == "0"
    assert first[-1]["resume"] == str(run_dir), first
    assert f"requeued (restart 1): resuming from {run_dir}" in batch_log(run_dir)

    slurm_cluster.run("scancel", "--batch", "--signal=USR1", jid)
    fields = wait_done(slurm_cluster, run_dir)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "2", batch_log(run_dir)
    after = events(tmp_path)[len(first) :]
    assert [(e["event"], e["restarts"]) for e in after] == [("checkpoint", "1"), ("resume", "2")], after
    log = batch_log(run_dir)
    assert "SIGUSR1: asking the driver to save a checkpoint" in log
    assert f"requeueing job {jid}" in log and f"requeued (restart 2): resuming from {run_dir}" in log


def test_a_job_runs_ray_and_the_driver_with_per_node_logs_and_cancel_stops_it_all(slurm_cluster, tmp_path):
    """A job whose name is shell code in every quoting: its Ray head starts, the driver runs with
    the W&B key in its environment and nowhere in the run directory; `status` and `logs` read it;
    `cancel` ends it, its Ray processes and its Ray folder."""
    from tests.slurm.conftest import _pids_with_env

    name = "smoke; touch PWNED $(touch PWNED2) `touch PWNED3` 'q\""
    run_dir = submit(slurm_cluster, tmp_path, name, "hold")
    wait_for(lambda: events(tmp_path), 300, "the driver started", run_dir)
    jid = job_id(run_dir)
    assert (
        job_fields(slurm_cluster, jid)["JobName"]
        == "moe-rl-smoke__touch_PWNED___touch_PWNED2___touch_PWNED3___q_"
    )
    (start,) = events(tmp_path)
    assert start["event"] == "start" and start["config"] == str(run_dir / "config.yaml")
    assert start["wandb_key"] == "set" and start["ray_token"] == "set" and start["ray"]
    assert "all 1 node(s) joined Ray" in batch_log(run_dir)
    (node_log,) = (run_dir / "logs").glob("*-node0.log")
    assert "Ray runtime started" in node_log.read_text()
    status = moe_rl(slurm_cluster, tmp_path, "status", str(run_dir))
    assert status.returncode == 0 and "RUNNING" in status.stdout, status.stdout
    logs = moe_rl(slurm_cluster, tmp_path, "logs", str(run_dir), "--node", "0")
    assert logs.returncode == 0 and "Ray runtime started" in logs.stdout

    out = moe_rl(slurm_cluster, tmp_path, "cancel", str(run_dir))
    assert out.returncode == 0 and f"cancelled job {jid}" in out.stdout
    fields = wait_done(slurm_cluster, run_dir, timeout=120)
    assert fields["JobState"] == "CANCELLED"
    status = moe_rl(slurm_cluster, tmp_path, "status", str(run_dir))
    assert "CANCELLED" in status.stdout
    ray_dir = f"/tmp/moe-rl-ray-moerltest-{jid}"
    wait_for(lambda: not _pids_with_env(f"RAY_TMPDIR={ray_dir}"), 60, "the job's Ray processes gone")
    wait_for(lambda: not Path(ray_dir).exists(), 30, f"{ray_dir} removed")
    assert not list(tmp_path.rglob("PWNED*")), "a run name executed as shell code"
    assert SECRET not in all_text(run_dir), "the W&B key landed in the run directory"


@pytest.mark.e2e
def test_tiny_recipe_trains_through_sbatch_with_two_ranks_and_two_engines(slurm_cluster, tmp_path):
    """The real driver: two RL steps of the tiny recipe with a trainer group of two ranks and two
    engine replicas, submitted like a cluster job (placed on the node by its Ray role resource)."""
    run_dir = submit(
        slurm_cluster, tmp_path, "tiny", None, "run.steps=2", "logging.progress=false",
        "parallel.trainer_world_size=2", "rollout.num_engines=2",
    )  # fmt: skip
    fields = wait_done(slurm_cluster, run_dir, timeout=800)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", batch_log(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2, records
    for record in records:
        assert (record["trainer/world_size"], record["rollout/engines"]) == (2, 2)
        assert "reward/mean" in record and record["sync/bytes"] > 0
    # the head node carries the trainer role as a Ray resource; ranks and engines asked for it
    assert "'moe_rl_trainer_node': 0.001}" in batch_log(run_dir) and "nodes by role: yes" in batch_log(
        run_dir
    )
