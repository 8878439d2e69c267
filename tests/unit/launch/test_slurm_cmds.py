"""`moe-rl status|logs|cancel|ray-wait` with stub Slurm commands (the real ones run in
tests/slurm)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from launch import slurm_cmds
from moe_rl.config import ConfigError


def _stub(folder: Path, name: str, body: str) -> None:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "slurm_job_id").write_text("77\n")
    (run / "logs" / "moe-rl-run-77.out").write_text("one\ntwo\nthree\n")
    (run / "logs" / "moe-rl-run-77-node0.log").write_text("head\n")
    (run / "logs" / "moe-rl-run-77-node1.log").write_text("worker\n")
    (run / "logs" / "moe-rl-run-12.out").write_text("an older job\n")
    return run


def test_missing_job_id_names_the_run_dir(tmp_path):
    with pytest.raises(ConfigError, match="no slurm_job_id"):
        slurm_cmds.read_job_id(tmp_path)


def test_status_prefers_squeue(run_dir, tmp_path, monkeypatch, capsys):
    _stub(tmp_path / "bin", "squeue", 'echo "RUNNING|1:02|1:00:00|2|node[1-2]"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert slurm_cmds.status_command(str(run_dir)) == 0
    assert capsys.readouterr().out.startswith("job 77: RUNNING (elapsed 1:02")


def test_status_falls_back_to_scontrol_without_accounting(run_dir, tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    _stub(bin_dir, "squeue", "exit 0")
    _stub(bin_dir, "sacct", 'echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1')
    _stub(bin_dir, "scontrol", 'echo "JobId=77 JobState=CANCELLED RunTime=00:00:09 ExitCode=0:15 Restarts=1"')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    slurm_cmds.status_command(str(run_dir))
    out = capsys.readouterr().out
    assert out.startswith("job 77: CANCELLED") and "restarts 1" in out


def test_logs_show_this_job_only(run_dir, capsys):
    assert slurm_cmds.logs_command(str(run_dir), lines=2) == 0
    out = capsys.readouterr().out
    assert "two\nthree" in out and "one" not in out and "head" in out and "worker" in out
    assert "older" not in out
    slurm_cmds.logs_command(str(run_dir), node=1)
    out = capsys.readouterr().out
    assert "worker" in out and "head" not in out


def test_cancel_calls_scancel(run_dir, tmp_path, monkeypatch, capsys):
    _stub(tmp_path / "bin", "scancel", 'echo "$@" > "$(dirname "$0")/args"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    assert slurm_cmds.cancel_command(str(run_dir)) == 0
    assert (tmp_path / "bin" / "args").read_text().strip() == "77"
    assert "cancelled job 77" in capsys.readouterr().out


def test_ray_wait_times_out_with_a_clear_error(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    assert slurm_cmds.wait_for_ray(f"127.0.0.1:{port}", nodes=2, timeout_s=1) == 1
    assert f"no Ray head answers at 127.0.0.1:{port}" in caplog.text
