"""A real one-node Slurm cluster for the `slurm` tests.

Started once per session, as root, in a private folder: its own munge key and socket, its own
slurm.conf (found through SLURM_CONF), its own ports, so it touches no system configuration and a
rerun starts clean. The Debian packages are installed when missing. At the end the fixture
cancels the jobs, ends every process those jobs left, stops slurmd, slurmctld and munged, and
removes the folder. In CI a skip here is a failure (tests/conftest.py), which is intended.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged")


@dataclass(frozen=True)
class SlurmCluster:
    """The running test cluster: its folder, its slurm.conf and the environment that reaches it."""

    root: Path
    conf: Path
    env: dict[str, str]

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=120)


def _ensure_packages() -> None:
    if os.geteuid() != 0:
        pytest.skip("the Slurm test cluster needs root (slurmd runs jobs as root here)")
    if all(shutil.which(b) for b in BINARIES):
        return
    if not shutil.which("apt-get"):
        pytest.skip(f"Slurm is not installed and there is no apt-get to install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update"], env=env, check=True, capture_output=True, timeout=600)
    subprocess.run(
        ["apt-get", "install", "-y", *PACKAGES], env=env, check=True, capture_output=True, timeout=900
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_memory() -> int:
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=False)
    found = re.search(r"RealMemory=(\d+)", out.stdout)
    return int(found.group(1)) if found else 20000


def _slurm_conf(root: Path, host: str) -> str:
    return "\n".join(
        [
            "ClusterName=moerltest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again
            f"AuthInfo=socket={root / 'munge.socket'},cred_expire=5",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=2,sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MinJobAge=600",
            "KillWait=15",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 2} "
            f"RealMemory={_real_memory()} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _start_munge(root: Path) -> None:
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    subprocess.run(
        ["munged", "--force", f"--socket={root / 'munge.socket'}", f"--key-file={key}",
         f"--log-file={root / 'munged.log'}", f"--pid-file={root / 'munged.pid'}",
         f"--seed-file={root / 'munged.seed'}"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip


def _wait(predicate: Callable[[], bool], timeout: float, what: str, logs: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1)
    tail = ""
    if logs is not None:
        tail = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(logs.glob("*.log")))
    raise TimeoutError(f"{what} not within {timeout:.0f} s\n{tail}")


def _node_idle(cluster: SlurmCluster) -> bool:
    out = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False)
    return out.returncode == 0 and out.stdout.strip().startswith("idle")


def _pids_with_env(needle: str) -> list[int]:
    """Processes whose environment contains `needle` (the jobs of this cluster carry SLURM_CONF)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle.encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _pidfile(path: Path) -> list[int]:
    try:
        return [int(path.read_text().strip())]
    except (OSError, ValueError):
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def _stop(cluster: SlurmCluster) -> None:
    cluster.run("scancel", "--user=root", check=False)
    time.sleep(2)
    daemons = {name: _pidfile(cluster.root / f"{name}.pid") for name in ("slurmd", "slurmctld", "munged")}
    leftovers = set(_pids_with_env(f"SLURM_CONF={cluster.conf}")) - {p for ps in daemons.values() for p in ps}
    _kill(sorted(leftovers), signal.SIGKILL)
    for pids in daemons.values():
        _kill(pids, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        _kill([p for p in pids if _alive(p)], signal.SIGKILL)
    for ray_dir in Path("/tmp").glob("moe-rl-ray-moerltest-*"):  # a job SIGKILLed before its cleanup
        shutil.rmtree(ray_dir, ignore_errors=True)
    shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Start the private one-node cluster; yields once sinfo shows the node idle."""
    _ensure_packages()
    root = Path(tempfile.mkdtemp(prefix="moe-rl-slurm-"))
    root.chmod(0o755)
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, socket.gethostname()))
    cluster = SlurmCluster(root, conf, {**os.environ, "SLURM_CONF": str(conf)})
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        _start_munge(root)
        cluster.run("slurmctld", "-f", str(conf))
        cluster.run("slurmd", "-f", str(conf))
        _wait(lambda: _node_idle(cluster), 60, "the test node idle in sinfo", logs=root)
        yield cluster
    finally:
        _stop(cluster)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
