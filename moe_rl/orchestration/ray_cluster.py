"""The Ray cluster a run's actors live in: joined (a Slurm job's, `RAY_ADDRESS`) or started for the
run (`start_ray`), with what of the driver's environment its actors need (`carried_env`)."""

from __future__ import annotations

import os
from pathlib import Path

import ray

from moe_rl.config.schema import RecipeConfig
from moe_rl.log import LOG_DIR_ENV
from moe_rl.orchestration.placement import PROCESS_ENV

PROJECT_ENV_PREFIX = "MOE_RL_"
CARRIED_ENV = ("PYTHONPATH",)
"""What else of the driver's environment a run takes into a joined cluster: the path the preflight
found the user's modules on (a reward function, an environment), which the actors import again."""


def carried_env() -> dict[str, str]:
    """What of this process's environment a run's actors need: the project's settings (``MOE_RL_*``,
    e.g. `moe_rl.orchestration.faults.FAULTS_ENV`) and `CARRIED_ENV`. A local cluster's workers inherit it; a joined cluster's
    get it through the run's Ray job runtime env (`start_ray`)."""
    return {
        key: value
        for key, value in os.environ.items()
        if key.startswith(PROJECT_ENV_PREFIX) or (key in CARRIED_ENV and value)
    }


def start_ray(config: RecipeConfig, log_dir: Path | None = None) -> None:
    """Join the Ray cluster of a Slurm job (RAY_ADDRESS) or start a local one sized for the run's
    processes (never one another run started on this machine); nothing when this process is
    connected to Ray already (the caller that connected it disconnects it: `ray.shutdown`). With
    ``log_dir`` every actor logs into it (`moe_rl.log.setup_actor_logging`); Ray still forwards
    what an actor prints to stderr (the project's warnings and errors, a crash) to this terminal."""
    if ray.is_initialized():
        return
    for key, value in PROCESS_ENV.items():  # inherited by the local cluster's processes
        os.environ.setdefault(key, value)
    logs = {LOG_DIR_ENV: str(Path(log_dir).resolve())} if log_dir else {}
    address = os.environ.get("RAY_ADDRESS")
    if address:  # the cluster's workers were started by others: the job's runtime env carries
        # the run's log folder and what else the actors need of the driver's environment
        env_vars = {**carried_env(), **logs}
        ray.init(
            address=address, log_to_driver=True, runtime_env={"env_vars": env_vars} if env_vars else None
        )
        return
    os.environ.update(logs)  # the local cluster's workers inherit the driver's environment
    processes = config.parallel.trainer_world_size + config.rollout.num_engines + 1
    # "local": a new cluster of this run's own, even when another (`ray start`) runs on this machine
    ray.init(
        address="local",
        num_cpus=max(processes, os.cpu_count() or 2),
        include_dashboard=False,
        log_to_driver=True,
    )
