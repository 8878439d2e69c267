"""`moe-rl submit`: resolve a recipe, render the sbatch script into the run directory, call sbatch.

The script (`slurm/ray_job.sbatch`) starts Ray over the allocation and runs `moe-rl train` on the
resolved recipe; on a requeue it runs `moe-rl train --resume RUN_DIR`. Every value that reaches
the script is quoted with `shlex.quote`, so a recipe value cannot inject shell code, and every `%`
of a path in a log file pattern (`--output`) is doubled, so Slurm expands only the pattern's own.
"""

from __future__ import annotations

import logging
import re
import shlex
import string
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from moe_rl.config import ConfigError, RecipeConfig, load_recipe, to_yaml
from moe_rl.config.validate import check_text
from moe_rl.orchestration.placement import PROCESS_ENV, placement_lines
from moe_rl.orchestration.preflight import load_checked
from moe_rl.run_dir import holds_a_run

log = logging.getLogger("moe_rl.submit")

TEMPLATE = Path(__file__).resolve().parents[1] / "slurm" / "ray_job.sbatch"
JOB_ID_FILE = "slurm_job_id"
SCRIPT_NAME = "job.sbatch"
CONFIG_NAME = "config.yaml"


class _SbatchTemplate(string.Template):
    """`@@name` placeholders: bash never writes `@@`, so `$VAR` and `"$@"` pass through."""

    delimiter = "@@"
    idpattern = r"[a-z_][a-z0-9_]*"


@dataclass(frozen=True)
class SlurmArgs:
    """The command-line flags of `moe-rl submit` that override the recipe's `cluster` section."""

    nodes: int | None = None
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    requeue: bool | None = None


def cluster_overrides(config: RecipeConfig, args: SlurmArgs) -> list[str]:
    """Recipe overrides for the numeric submit flags (`--nodes` resizes the trainer)."""
    from launch.plan import node_overrides

    out = node_overrides(config, args.nodes, args.gpus_per_node)
    if args.requeue is not None:
        out.append(f"cluster.requeue={str(args.requeue).lower()}")
    return out


def resolve(recipe: str, overrides: Sequence[str], args: SlurmArgs, paths: bool = True) -> RecipeConfig:
    """Load, resize and validate the recipe, apply the string flags (partition, account, time)
    as given, and make the run directory an absolute path. ``paths``: check the input paths here
    (the job's nodes are expected to see them where this machine does)."""
    base = load_recipe(recipe, overrides)
    config = load_checked(recipe, [*overrides, *cluster_overrides(base, args)], paths=paths)
    strings = {k: getattr(args, k) for k in ("partition", "time", "account") if getattr(args, k) is not None}
    output_dir = str(Path(config.run.output_dir).expanduser().resolve())
    config = replace(
        config, run=replace(config.run, output_dir=output_dir), cluster=replace(config.cluster, **strings)
    )
    _check_submittable(config)
    return config


FLAG_FIELDS = (
    "cluster.nodes", "cluster.trainer_nodes", "cluster.gpus_per_node", "parallel.trainer_world_size",
    "cluster.partition", "cluster.time", "cluster.account", "cluster.requeue",
)  # fmt: skip
"""The recipe values the submit flags set (`--nodes` moves the trainer's nodes and world size too)."""


def flag_changes(base: RecipeConfig, config: RecipeConfig) -> list[str]:
    """Each recipe value the flags changed, as `key: recipe → flags` (the recipe with its overrides
    against what is submitted): a flag never replaces a recipe's value unsaid."""

    def value(c: RecipeConfig, key: str):
        section, field = key.split(".")
        return getattr(getattr(c, section), field)

    return [
        f"{key}: {value(base, key)} → {value(config, key)}"
        for key in FLAG_FIELDS
        if value(base, key) != value(config, key)
    ]


MANAGED_OPTIONS = ("-o", "--output", "-e", "--error")
"""sbatch options `moe-rl submit` sets itself: the job's log goes where `moe-rl logs` reads it."""


def _check_submittable(config: RecipeConfig) -> None:
    """Values that become file names or `#SBATCH` lines (`load_recipe` checked everything else,
    `run.name` included)."""
    c = config.cluster
    for field, value in (
        ("run.output_dir", config.run.output_dir),
        ("cluster.partition", c.partition),
        ("cluster.account", c.account),
        ("cluster.time", c.time),
    ):
        check_text(field, value)
    if "\\" in config.run.output_dir:
        raise ConfigError(
            f"run.output_dir={config.run.output_dir!r} contains `\\`: sbatch and srun would then leave "
            "%x and %j in the log file names unexpanded; use a folder without backslashes"
        )
    for i, option in enumerate(c.extra_sbatch):
        _check_extra_option(f"cluster.extra_sbatch[{i}]", option)


def _check_extra_option(field: str, option: str) -> None:
    check_text(field, option)
    if not option.startswith("-"):
        raise ConfigError(f"{field}={option!r} must be an sbatch option (`--qos=high`)")
    name = option.split("=", 1)[0] if option.startswith("--") else option[:2]
    if name in MANAGED_OPTIONS:
        raise ConfigError(
            f"{field}={option!r}: moe-rl submit sets {name} itself (logs go to <run dir>/logs); "
            "choose the folder with run.output_dir and run.name"
        )


def log_pattern(path: Path) -> str:
    """`path` for an sbatch / srun `--output` pattern: a `%` of the path itself is doubled (`%%` is
    a literal `%`), so only the pattern's own `%x`, `%j`, `%n` expand."""
    return str(path).replace("%", "%%")


def run_dir_of(config: RecipeConfig) -> Path:
    return Path(config.run.output_dir) / config.run.name


def job_name(config: RecipeConfig) -> str:
    """The Slurm job name: `moe-rl-<run name>` with anything unusual replaced by `_`."""
    return "moe-rl-" + re.sub(r"[^A-Za-z0-9_.-]", "_", config.run.name)


def sbatch_options(config: RecipeConfig, workdir: Path) -> list[str]:
    """The `#SBATCH` lines (each value quoted; sbatch reads them with shell quoting)."""
    c, q = config.cluster, shlex.quote
    logs = run_dir_of(config) / "logs"
    options = [
        f"--job-name={q(job_name(config))}",
        f"--nodes={c.nodes}",
        "--ntasks-per-node=1",
        "--exclusive",
        "--mem=0",
        f"--time={q(c.time)}",
        f"--chdir={q(str(workdir))}",
        f"--output={q(log_pattern(logs) + '/%x-%j.out')}",
        "--open-mode=append",
        "--export=ALL",
        f"--signal=B:USR1@{int(c.signal_grace_s)}",
        "--requeue" if c.requeue else "--no-requeue",
    ]
    if c.gpus_per_node > 0:
        options.insert(3, f"--gpus-per-node={c.gpus_per_node}")
    if c.partition:
        options.append(f"--partition={q(c.partition)}")
    if c.account:
        options.append(f"--account={q(c.account)}")
    options += [q(option) for option in c.extra_sbatch]
    return [f"#SBATCH {option}" for option in options]


def train_command(config_path: Path, command: str | None = None) -> list[str]:
    """The driver command: `moe-rl train CONFIG`, or `command` (split like a shell) given CONFIG."""
    words = shlex.split(command) if command else ["moe-rl", "train"]
    return [*words, str(config_path)]


def render_script(
    config: RecipeConfig, workdir: Path, command: str | None = None, bin_dir: Path | None = None
) -> str:
    """The sbatch script of `config` (run directory, Ray ports and driver command filled in)."""
    q = shlex.quote
    run_dir = run_dir_of(config)
    values = {
        "sbatch_options": "\n".join(sbatch_options(config, workdir)),
        "run_dir": q(str(run_dir)),
        "log_dir": q(str(run_dir / "logs")),
        "log_pattern": q(log_pattern(run_dir / "logs")),
        "ray_port": q(str(config.cluster.ray_port)),
        "ray_join_timeout": q(str(config.cluster.ray_join_timeout_s)),
        "gpus_per_node": q(str(config.cluster.gpus_per_node)),
        "trainer_nodes": q(str(config.cluster.trainer_nodes)),
        "min_cpus": q(str(config.parallel.trainer_world_size + config.rollout.num_engines + 1)),
        "requeue": "1" if config.cluster.requeue else "0",
        "train_command": " ".join(q(w) for w in train_command(run_dir / CONFIG_NAME, command)),
        "bin_dir": q(str(bin_dir or Path(sys.executable).parent)),
        "process_env": "\n".join(f"export {key}={q(value)}" for key, value in PROCESS_ENV.items()),
    }
    return _SbatchTemplate(TEMPLATE.read_text()).substitute(values)


def write_run_dir(config: RecipeConfig, script: str) -> Path:
    """Write the resolved recipe and the script into the run directory; return the script path."""
    run_dir = run_dir_of(config)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_NAME).write_text(to_yaml(config))
    path = run_dir / SCRIPT_NAME
    path.write_text(script)
    path.chmod(0o755)
    return path


def parse_job_id(sbatch_stdout: str) -> str:
    """The job id from `sbatch --parsable` output (`123` or `123;cluster`)."""
    job_id = sbatch_stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch did not print a job id: {sbatch_stdout!r}")
    return job_id


def call_sbatch(script: Path) -> str:
    """Submit `script`; returns the job id."""
    try:
        out = subprocess.run(
            ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False
        )
    except FileNotFoundError as exc:
        raise RuntimeError("sbatch not found: run `moe-rl submit` on a Slurm login node") from exc
    if out.returncode != 0:
        raise RuntimeError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
    return parse_job_id(out.stdout)


def submit(
    recipe: str, overrides: Sequence[str], args: SlurmArgs, dry_run: bool = False, command: str | None = None,
    paths: bool = True,
) -> int:  # fmt: skip
    """`moe-rl submit`: returns the exit code; prints the script and command with `dry_run`."""
    config = resolve(recipe, overrides, args, paths)
    run_dir = run_dir_of(config)
    script = render_script(config, Path.cwd(), command)
    placement = "".join(f"#   {line}\n" for line in placement_lines(config))
    changed = flag_changes(load_recipe(recipe, overrides), config)
    flags = (
        "# the flags change the recipe:\n" + "".join(f"#   {line}\n" for line in changed) if changed else ""
    )
    if dry_run:
        sys.stdout.write(script)
        sys.stdout.write(f"\n{flags}# placement:\n{placement}")
        sys.stdout.write(
            f"# would write {run_dir / CONFIG_NAME} and run: sbatch --parsable "
            f"{q_path(run_dir / SCRIPT_NAME)}\n"
        )
        return 0
    if holds_a_run(run_dir):
        raise ConfigError(
            f"run directory {run_dir} already holds a run (metrics or checkpoints); continue it with "
            f"`moe-rl train --resume {run_dir}` or submit under another run.name"
        )
    if (run_dir / JOB_ID_FILE).exists():
        log.warning(
            "%s already holds job %s; it is replaced by the new job",
            run_dir,
            (run_dir / JOB_ID_FILE).read_text().strip(),
        )
    job_id = call_sbatch(write_run_dir(config, script))
    (run_dir / JOB_ID_FILE).write_text(job_id + "\n")
    sys.stdout.write(
        f"submitted job {job_id}: {run_dir}\n{flags}{placement}"
        f"  moe-rl status {q_path(run_dir)}    moe-rl logs {q_path(run_dir)}\n"
    )
    return 0


def q_path(path: Path) -> str:
    return shlex.quote(str(path))
