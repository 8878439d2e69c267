"""`moe-rl submit`: the rendered sbatch script, its quoting (run in bash with stub Slurm and Ray
commands), fast failures, and the dry run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launch.submit import SlurmArgs, parse_job_id, render_script, resolve, sbatch_options, submit
from moe_rl.config import ConfigError
from moe_rl.orchestration.placement import PROCESS_ENV

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "recipes" / "tiny_moe.yaml")
KIMI = str(REPO / "recipes" / "kimi_k2.yaml")
QWEN = str(REPO / "recipes" / "qwen3_30b_a3b.yaml")
CPU = SlurmArgs(nodes=1, gpus_per_node=0)
EVIL = "x; touch PWNED1; $(touch PWNED2) `touch PWNED3` 'q\" * ~"

STUB = """#!/bin/bash
# one record, one append: stubs run concurrently (srun in the background), so a record written in
# two pieces could interleave with another process's record
record=$(mktemp)
{ printf '%s\\0' "$(basename "$0")" "$@"; printf '\\n'; } > "$record"
cat "$record" >> "$STUB_LOG"
rm -f "$record"
env > "$STUB_LOG.$(basename "$0").env"  # the environment it was started with (the last call's)
if [[ "$1" == ray-wait ]]; then  # like the real one, return once the head (srun) has started
  for _ in $(seq 100); do grep -qa srun "$STUB_LOG" && exit 0; sleep 0.1; done
  exit 1
fi
"""


def _stub_bin(folder: Path) -> Path:
    """`moe-rl`, `srun` and `scontrol` that record their arguments (NUL-separated) and succeed."""
    folder.mkdir()
    for name in ("moe-rl", "srun", "scontrol"):
        path = folder / name
        path.write_text(STUB)
        path.chmod(0o755)
    return folder


def _calls(log: Path) -> list[list[str]]:
    return [line.strip("\0").split("\0") for line in log.read_text().split("\0\n") if line.strip("\0")]


def _run_script(script: str, tmp_path: Path, restarts: int) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "job.sbatch").write_text(script)
    log = tmp_path / "stub.log"
    env = {
        "PATH": os.environ["PATH"],
        "STUB_LOG": str(log),
        "SLURM_JOB_ID": f"unit{os.getpid()}",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURMD_NODENAME": "node0",
        "SLURM_RESTART_COUNT": str(restarts),
        "SLURM_CLUSTER_NAME": "unit",
    }
    out = subprocess.run(
        ["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    return out, log


@pytest.mark.parametrize("restarts", [0, 1], ids=["first-start", "requeued"])
def test_hostile_values_stay_inert_in_bash(tmp_path, restarts):
    overrides = [f"run.name={EVIL}", f"run.output_dir={tmp_path / 'out $(touch PWNED4)'}"]
    overrides.append("cluster.extra_sbatch=['--comment=a$(touch PWNED5)']")
    config = resolve(TINY, overrides, SlurmArgs(1, 0, partition="p; touch PWNED6", account="a`touch PWNED7`"))
    script = render_script(config, tmp_path, bin_dir=_stub_bin(tmp_path / "bin"))
    out, log = _run_script(script, tmp_path, restarts)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not list(tmp_path.rglob("PWNED*")), out.stdout
    run_dir = str(tmp_path / "out $(touch PWNED4)" / EVIL)
    train = [c for c in _calls(log) if c[:2] == ["moe-rl", "train"]]
    resume = ["--resume", run_dir] if restarts else []
    assert train == [["moe-rl", "train", f"{run_dir}/config.yaml", *resume]]
    srun = next(c for c in _calls(log) if c[0] == "srun")
    assert f"--output={run_dir}/logs/%x-%j-node%n.log" in srun
    assert "--head" in srun and "--block" in srun
    for name in ("srun", "moe-rl"):  # Ray's processes on every node, and the driver, start with it
        started_with = (tmp_path / f"stub.log.{name}.env").read_text().splitlines()
        assert {f"{key}={value}" for key, value in PROCESS_ENV.items()} <= set(started_with)


def test_sbatch_lines_are_quoted_like_a_shell_reads_them(tmp_path):
    config = resolve(TINY, [f"run.name={EVIL}"], SlurmArgs(1, 0, partition="gpu q", account="it's"))
    lines = sbatch_options(config, tmp_path)
    parsed = [shlex.split(line.removeprefix("#SBATCH ")) for line in lines]
    assert all(len(words) == 1 for words in parsed), lines
    flat = {w.split("=", 1)[0]: w.split("=", 1)[1] for (w,) in parsed if "=" in w}
    assert flat["--partition"] == "gpu q" and flat["--account"] == "it's"
    assert re.fullmatch(r"moe-rl-x_[A-Za-z0-9_.-]+", flat["--job-name"])


def test_gpu_and_requeue_options():
    cpu = sbatch_options(resolve(TINY, [], CPU), Path("/w"))
    assert not any("--gpus-per-node" in line for line in cpu)
    assert "#SBATCH --no-requeue" in cpu
    gpu = sbatch_options(resolve(KIMI, [], SlurmArgs(nodes=64), paths=False), Path("/w"))
    assert "#SBATCH --gpus-per-node=8" in gpu and "#SBATCH --nodes=64" in gpu
    assert "#SBATCH --requeue" in gpu and "#SBATCH --signal=B:USR1@300" in gpu


@pytest.mark.parametrize(
    ("overrides", "args", "expected"),
    [
        (["run.name=a/b"], CPU, "run.name='a/b' must be a plain folder name"),
        (["cluster.extra_sbatch=[qos]"], CPU, "cluster.extra_sbatch[0]='qos' must be an sbatch option"),
        ([], SlurmArgs(1, 0, time="1:00\n#SBATCH --x"), "cluster.time="),
        ([], SlurmArgs(nodes=63), "parallel.trainer_world_size=376"),
        (["rollout.num_engines=9"], SlurmArgs(), "engine GPUs"),
        (["trainer.lrr=1"], CPU, "did you mean `trainer.lr`"),
    ],
)
def test_bad_submissions_fail_before_sbatch(overrides, args, expected):
    recipe = TINY if args.gpus_per_node == 0 else KIMI
    with pytest.raises(ConfigError) as info:
        resolve(recipe, overrides, args, paths=False)
    assert expected in str(info.value)


def test_control_characters_are_refused(tmp_path):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "quant").symlink_to(REPO / "recipes" / "quant")
    (recipes / "bad.yaml").write_text('run:\n  name: "a\\nb"\n')
    with pytest.raises(ConfigError, match=r"run.name='a\\nb' contains a control character"):
        resolve(str(recipes / "bad.yaml"), [], CPU)


def test_dry_run_refuses_a_recipe_whose_dataset_is_not_here(tmp_path):
    """As the job would see it (the submitting machine shares the cluster's filesystem), unless told
    the paths exist only there."""
    with pytest.raises(
        ConfigError, match=r"data.task=file:data/dapo_math_17k.jsonl: no such file .*--skip-path-checks"
    ):
        submit(KIMI, [f"run.output_dir={tmp_path / 'runs'}"], SlurmArgs(nodes=64), dry_run=True)


def test_dry_run_prints_script_and_writes_nothing(tmp_path, capsys):
    code = submit(
        KIMI, [f"run.output_dir={tmp_path / 'runs'}"], SlurmArgs(nodes=64), dry_run=True, paths=False
    )
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("#!/bin/bash") and "#SBATCH --nodes=64" in out
    assert f"sbatch --parsable {tmp_path / 'runs' / 'kimi_k2' / 'job.sbatch'}" in out
    assert not (tmp_path / "runs").exists()


def test_flags_that_change_the_recipe_are_said(tmp_path, capsys):
    """A flag equal to the recipe's value is no change; each one that differs is listed, with the
    values it moved with it (the trainer's nodes and world size)."""
    args = SlurmArgs(nodes=6, time="80:00:00", partition="batch")
    code = submit(QWEN, [f"run.output_dir={tmp_path / 'runs'}"], args, dry_run=True, paths=False)
    out = capsys.readouterr().out
    assert code == 0
    said = out[out.index("# the flags change the recipe:\n") :].split("# placement:")[0].splitlines()[1:]
    assert said == [
        "#   cluster.nodes: 4 → 6",
        "#   cluster.trainer_nodes: 2 → 4",
        "#   parallel.trainer_world_size: 16 → 32",
        "#   cluster.partition: None → batch",
        "#   cluster.time: 24:00:00 → 80:00:00",
    ]
    submit(
        QWEN,
        [f"run.output_dir={tmp_path / 'runs'}"],
        SlurmArgs(nodes=4, gpus_per_node=8),
        dry_run=True,
        paths=False,
    )
    assert "the flags change" not in capsys.readouterr().out


def test_gpu_recipe_on_zero_gpus_per_node_says_what_is_missing(tmp_path):
    with pytest.raises(ConfigError) as caught:
        submit(QWEN, [f"run.output_dir={tmp_path}"], SlurmArgs(gpus_per_node=0), dry_run=True, paths=False)
    assert str(caught.value) == (
        "placement: GPUs per node given: cluster.gpus_per_node=0 with run.device=cuda on GPUs: without a GPU "
        "count the run gets one GPU, for one trainer rank and one engine, but the recipe has "
        "parallel.trainer_world_size=16 and rollout.num_engines=16; set cluster.gpus_per_node to each node's "
        "GPUs (0 is for CPU nodes)"
    )


def test_dry_run_script_passes_bash_syntax_check(tmp_path):
    script = render_script(resolve(KIMI, [], SlurmArgs(nodes=64), paths=False), tmp_path)
    (tmp_path / "job.sbatch").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], check=True)


def test_submit_writes_run_dir_and_job_id(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\necho "$@" > "$(dirname "$0")/args"\necho "4242;cluster"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    code = submit(TINY, [f"run.output_dir={tmp_path / 'runs'}"], CPU)
    run_dir = tmp_path / "runs" / "tiny_moe"
    assert code == 0 and "submitted job 4242" in capsys.readouterr().out
    assert (run_dir / "slurm_job_id").read_text() == "4242\n"
    assert (run_dir / "config.yaml").is_file() and (run_dir / "logs").is_dir()
    assert (bin_dir / "args").read_text().split() == ["--parsable", str(run_dir / "job.sbatch")]
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')  # the job ran: a second submit is refused
    with pytest.raises(ConfigError, match="already holds a run .*moe-rl train --resume"):
        submit(TINY, [f"run.output_dir={tmp_path / 'runs'}"], CPU)


def test_missing_sbatch_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="sbatch not found"):
        submit(TINY, [f"run.output_dir={tmp_path / 'runs'}"], CPU)


def test_parse_job_id():
    assert parse_job_id("123\n") == "123"
    assert parse_job_id("77;gpu-cluster\n") == "77"
    with pytest.raises(RuntimeError, match="job id"):
        parse_job_id("Submitted batch job 5")


def test_cli_submit_fails_fast_on_a_bad_recipe(tmp_path):
    cmd = [sys.executable, "-m", "launch.cli", "submit", "--dry-run", TINY, "trainer.lrr=1"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "trainer.lr" in out.stderr
