"""`moe-rl status|logs|cancel RUN_DIR` (squeue / sacct / scontrol / scancel on the job id that
`moe-rl submit` recorded in the run directory) and `moe-rl ray-wait` (used by the sbatch script)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from moe_rl.config import ConfigError

log = logging.getLogger("moe_rl.slurm")

JOB_ID_FILE = "slurm_job_id"


def read_job_id(run_dir: str | Path) -> str:
    """The Slurm job id recorded by `moe-rl submit` in `run_dir`."""
    path = Path(run_dir) / JOB_ID_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no {JOB_ID_FILE} (was this run directory made by `moe-rl submit`?)")
    return path.read_text().strip()


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
    except FileNotFoundError as exc:
        raise RuntimeError(f"{cmd[0]} not found: run this on a Slurm login node") from exc


def _from_squeue(job_id: str) -> dict[str, str] | None:
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%M|%l|%D|%R"])
    line = out.stdout.strip().splitlines()[:1]
    if out.returncode != 0 or not line:
        return None
    state, elapsed, limit, nodes, reason = line[0].split("|", 4)
    return {"state": state, "elapsed": elapsed, "time limit": limit, "nodes": nodes, "reason": reason}


def _from_sacct(job_id: str) -> dict[str, str] | None:
    out = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,Elapsed,ExitCode,NNodes"])
    line = out.stdout.strip().splitlines()[-1:]
    if out.returncode != 0 or not line:
        return None
    state, elapsed, exit_code, nodes = line[0].split("|", 3)
    return {"state": state, "elapsed": elapsed, "exit code": exit_code, "nodes": nodes}


def _from_scontrol(job_id: str) -> dict[str, str] | None:
    out = _run(["scontrol", "show", "job", "-o", job_id])
    if out.returncode != 0 or not out.stdout.strip():
        return None
    fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
    keys = {
        "JobState": "state",
        "RunTime": "elapsed",
        "ExitCode": "exit code",
        "NumNodes": "nodes",
        "Restarts": "restarts",
        "Reason": "reason",
    }
    return {name: fields[key] for key, name in keys.items() if key in fields}


def job_status(job_id: str) -> dict[str, str]:
    """State of `job_id`: squeue while queued or running, then sacct, then scontrol (recent jobs
    on clusters without accounting)."""
    for source in (_from_squeue, _from_sacct, _from_scontrol):
        info = source(job_id)
        if info:
            return info
    return {"state": "UNKNOWN", "reason": "not in squeue, sacct or scontrol"}


def status_command(run_dir: str) -> int:
    job_id = read_job_id(run_dir)
    info = job_status(job_id)
    details = ", ".join(f"{k} {v}" for k, v in info.items() if k != "state" and v)
    sys.stdout.write(f"job {job_id}: {info['state']} ({details})\n")
    return 0


def log_files(run_dir: str | Path, job_id: str, node: int | None = None) -> list[Path]:
    """The job's batch log and per-node logs in `<run_dir>/logs` (only node `node` if given)."""
    logs = Path(run_dir) / "logs"
    batch = sorted(logs.glob(f"*-{job_id}.out"))
    nodes = sorted(logs.glob(f"*-{job_id}-node*.log"))
    if node is not None:
        return [p for p in nodes if p.name.endswith(f"-node{node}.log")]
    return batch + nodes


def _tail(path: Path, lines: int) -> str:
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) if lines > 0 else "\n".join(text)


def logs_command(run_dir: str, node: int | None = None, lines: int = 50, follow: bool = False) -> int:
    job_id = read_job_id(run_dir)
    files = log_files(run_dir, job_id, node)
    if not files:
        sys.stdout.write(f"job {job_id}: no logs yet in {Path(run_dir) / 'logs'}\n")
        return 1
    if follow:
        os.execvp("tail", ["tail", "-n", str(lines), "-F", *map(str, files)])
    for path in files:
        sys.stdout.write(f"==> {path} <==\n{_tail(path, lines)}\n")
    return 0


def cancel_command(run_dir: str) -> int:
    job_id = read_job_id(run_dir)
    out = _run(["scancel", job_id])
    if out.returncode != 0:
        sys.stdout.write(f"scancel {job_id} failed: {out.stderr.strip()}\n")
        return 1
    sys.stdout.write(f"cancelled job {job_id}\n")
    return 0


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _alive_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def wait_for_ray(address: str, nodes: int, timeout_s: float) -> int:
    """Block until `nodes` nodes are alive in the Ray cluster at `address` (host:port); returns
    the exit code (1 with an error naming the count on timeout)."""
    deadline = time.monotonic() + timeout_s
    host, _, port = address.rpartition(":")
    while not _port_open(host, int(port)):
        if time.monotonic() > deadline:
            log.error("no Ray head answers at %s after %.0f s", address, timeout_s)
            return 1
        time.sleep(1)
    import ray

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    try:
        alive = _alive_nodes()
        while alive < nodes and time.monotonic() < deadline:
            time.sleep(2)
            alive = _alive_nodes()
    finally:
        ray.shutdown()
    if alive < nodes:
        log.error("%d of %d node(s) joined Ray at %s within %.0f s", alive, nodes, address, timeout_s)
        return 1
    log.info("%d node(s) alive in Ray at %s", alive, address)
    return 0
