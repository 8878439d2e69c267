"""The `moe-rl` command line. Parses and validates before importing anything heavy, so a bad recipe
fails in a second rather than after Megatron loads."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_rl.config import ConfigError
from moe_rl.config.modes import LoraExport
from moe_rl.errors import UserError, user_error_of
from moe_rl.log import setup_logging
from moe_rl.orchestration.preflight import SKIP_PATHS, load_checked

log = logging.getLogger("moe_rl.cli")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny_moe.yaml")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. trainer.lr=2e-6")


def _add_paths_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        SKIP_PATHS, dest="check_paths", action="store_false",
        help="do not check that the dataset, stored trajectories and model checkpoint exist here "
        "(they exist only on the cluster)",
    )  # fmt: skip


def _sweep_arg(text: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2,...`` of `plan --sweep`: the recipe key and its values."""
    key, _, values = text.partition("=")
    parts = [v.strip() for v in values.split(",")]
    if not key.strip() or "." not in key or not all(parts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected section.key=V1,V2,... (e.g. cluster.rollout_nodes=4,8,16)"
        )
    return key.strip(), parts


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-rl", description=__doc__)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, help="default INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run the RL job of a recipe")
    _add_recipe_args(train)
    train.add_argument(
        "--log-level", type=str.upper, choices=LOG_LEVELS, default=argparse.SUPPRESS,
        help="replaces logging.level for this run; DEBUG also shows the libraries' messages (logs/ has them)",
    )  # fmt: skip
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    train.add_argument(
        "--force-new", action="store_true",
        help="start over in a run directory that holds a run (deletes its checkpoints and metrics)",
    )  # fmt: skip

    sft = sub.add_parser(
        "sft", help="supervised warm start: train a recipe's model on demonstrations (sft.demonstrations)"
    )
    _add_recipe_args(sft)
    sft.add_argument("--resume", metavar="RUN_DIR", help="continue an SFT run from its last checkpoint")
    sft.add_argument(
        "--force-new", action="store_true", help="start over in a run directory that holds a run"
    )
    train.add_argument(
        "--init-from",
        metavar="RUN",
        help="start from the weights of this run's newest checkpoint (e.g. an SFT run)",
    )

    config = sub.add_parser("config", help="inspect recipes")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved recipe as YAML")
    _add_recipe_args(show)
    _add_paths_flag(show)
    check = config_sub.add_parser("check", help="load and validate recipes; print OK or the error")
    check.add_argument(
        "recipes", nargs="+", help="recipe YAML files, then section.key=value overrides for all"
    )
    _add_paths_flag(check)
    config_sub.add_parser(
        "docs", help="print the recipe reference (every key, type, default, meaning) as markdown"
    )
    _add_slurm_parsers(sub)
    _add_diagnostics_parsers(sub)
    _add_export_parser(sub)
    return parser


def _add_slurm_parsers(sub: argparse._SubParsersAction) -> None:
    submit = sub.add_parser(
        "submit", help="submit a recipe as a Slurm job (flags before RECIPE or after the overrides)"
    )
    _add_recipe_args(submit)
    submit.add_argument(
        "--nodes", type=int, help="nodes in all (the trainer gets those the rollout does not)"
    )
    submit.add_argument("--gpus-per-node", type=int, help="GPUs per node (0: a CPU cluster)")
    submit.add_argument("--partition", help="Slurm partition")
    submit.add_argument("--time", help="time limit, e.g. 24:00:00")
    submit.add_argument("--account", help="Slurm account")
    submit.add_argument(
        "--requeue", action="store_true", default=None, help="requeue on preemption and resume"
    )
    submit.add_argument("--dry-run", action="store_true", help="print the sbatch script and command only")
    _add_paths_flag(submit)
    submit.add_argument(
        "--command",
        dest="driver_command",
        metavar="CMD",
        help="run this instead of `moe-rl train` (cluster smoke tests); it gets CONFIG [--resume RUN_DIR]",
    )

    plan = sub.add_parser(
        "plan", help="parameters, memory per GPU, step time by phase and parallel constraints of a recipe"
    )
    _add_recipe_args(plan)
    plan.add_argument("--nodes", type=int, help="plan for this many nodes in all")
    plan.add_argument(
        "--sweep", type=_sweep_arg, metavar="KEY=V1,V2,...",
        help="one row per value of a recipe key: the step's phases, its time and the verdict "
        "(cluster.rollout_nodes also sets the engines and nodes, cluster.trainer_nodes the world size)",
    )  # fmt: skip
    _add_paths_flag(plan)

    make_model = sub.add_parser(
        "make-model",
        help="a random-init checkpoint of a recipe's model (and a chat tokenizer) at model.hf_path",
    )
    _add_recipe_args(make_model)
    make_model.add_argument("--out", metavar="DIR", help="write here instead of the recipe's model.hf_path")
    make_model.add_argument("--force", action="store_true", help="write into a folder that is not empty")

    for name, text in (
        ("status", "state of a submitted run's Slurm job"),
        ("cancel", "cancel a submitted run's job"),
    ):
        sub.add_parser(name, help=text).add_argument("run_dir", help="run directory made by `moe-rl submit`")
    logs = sub.add_parser("logs", help="print a submitted run's batch and per-node logs")
    logs.add_argument("run_dir", help="run directory made by `moe-rl submit`")
    logs.add_argument("--node", type=int, help="only this node's log (0 = the Ray head)")
    logs.add_argument("-n", "--lines", type=int, default=50, help="last lines of each log (0: all)")
    logs.add_argument("-f", "--follow", action="store_true", help="follow the logs (tail -F)")

    wait = sub.add_parser(
        "ray-wait", help="wait until N nodes joined a Ray cluster (used by the sbatch script)"
    )
    wait.add_argument("--address", required=True, help="Ray head host:port")
    wait.add_argument("--nodes", type=int, required=True, help="nodes to wait for")
    wait.add_argument("--timeout", type=float, default=300, help="seconds")


def _add_diagnostics_parsers(sub: argparse._SubParsersAction) -> None:
    diagnose = sub.add_parser(
        "diagnose", help="zero-update test: engine vs trainer at the same weights, per quantization recipe"
    )
    _add_recipe_args(diagnose)
    diagnose.add_argument(
        "--quant",
        metavar="NAMES",
        help="comma-separated rollout.quant recipes, e.g. bf16,fp8_block128,int4_awq",
    )
    diagnose.add_argument(
        "--prompts", type=int, default=64, help="prompts (each sampled rollout.group_size times)"
    )
    diagnose.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    diagnose.add_argument(
        "--budget-png", metavar="OUT", help="also draw the mismatch budget, a stacked bar per recipe (PNG)"
    )
    report = sub.add_parser("report", help="plots and a markdown summary of a run directory's metrics")
    report.add_argument("run_dir", help="run directory with metrics.jsonl")
    report.add_argument("--out", help="output folder (default RUN_DIR/report)")


def _add_export_parser(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export", help="a run's checkpoint as a Hugging Face folder (safetensors) for transformers and vLLM"
    )
    export.add_argument("run_dir", help="run directory with config.yaml and checkpoints/")
    export.add_argument("out", help="folder to write (absent or empty, unless --force)")
    export.add_argument(
        "--step", type=int, metavar="N", help="the checkpoint of step N (default: the newest usable one)"
    )
    export.add_argument(
        "--shard-size", default="5GB", metavar="SIZE", help="largest shard (default 5GB; 500MB, 2GiB)"
    )
    export.add_argument("--force", action="store_true", help="replace OUT when it is not empty")
    export.add_argument(
        "--lora", choices=[str(m) for m in LoraExport], default=str(LoraExport.MERGED),
        help="of a LoRA run: the merged model (default), the PEFT-style adapter folder, or the frozen base",
    )  # fmt: skip


def _config_command(args: argparse.Namespace) -> int:
    from moe_rl.config import to_yaml

    if args.config_command == "show":
        sys.stdout.write(to_yaml(load_checked(args.recipe, args.overrides, paths=args.check_paths)))
        return 0
    if args.config_command == "docs":
        from moe_rl.config.docs import render_recipe_docs

        sys.stdout.write(render_recipe_docs())
        return 0
    failed = 0
    recipes = [r for r in args.recipes if "=" not in r or _is_file(r)]
    overrides = [r for r in args.recipes if r not in recipes]  # `section.key=value`, for every recipe
    for recipe in recipes:
        try:
            load_checked(recipe, overrides, paths=args.check_paths)
            sys.stdout.write(f"OK    {recipe}\n")
        except ConfigError as exc:
            failed += 1
            sys.stdout.write(f"FAIL  {recipe}: {exc}\n")
    return 1 if failed else 0


def _is_file(path: str) -> bool:
    """Whether ``path`` names a file (an argument no file system takes as a name, say an override
    longer than a name may be, is not one)."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def _train_command(args: argparse.Namespace) -> int:
    from launch.train import train

    init = getattr(args, "init_from", None)
    overrides = [*args.overrides, f"model.init_from={init}"] if init else args.overrides
    return train(
        args.recipe, overrides, resume=args.resume, force_new=args.force_new, log_level=args.log_level,
        sft=args.command == "sft",
    )  # fmt: skip


def _submit_command(args: argparse.Namespace) -> int:
    from launch.submit import SlurmArgs, submit

    slurm = SlurmArgs(args.nodes, args.gpus_per_node, args.partition, args.time, args.account, args.requeue)
    try:
        return submit(
            args.recipe, args.overrides, slurm, dry_run=args.dry_run, command=args.driver_command,
            paths=args.check_paths,
        )  # fmt: skip
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1


def _plan_command(args: argparse.Namespace) -> int:
    from launch.plan import plan_command

    return plan_command(
        args.recipe, args.overrides, nodes=args.nodes, paths=args.check_paths, sweep=args.sweep
    )


def _make_model_command(args: argparse.Namespace) -> int:
    from launch.make_model import make_model_command

    return make_model_command(args.recipe, args.overrides, args.out, args.force)


def _slurm_command(args: argparse.Namespace) -> int:
    from launch import slurm_cmds

    try:
        if args.command == "status":
            return slurm_cmds.status_command(args.run_dir)
        if args.command == "cancel":
            return slurm_cmds.cancel_command(args.run_dir)
        return slurm_cmds.logs_command(args.run_dir, args.node, args.lines, args.follow)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1


def _diagnose_command(args: argparse.Namespace) -> int:
    from launch.diagnose import diagnose_command

    return diagnose_command(args.recipe, args.overrides, args.quant, args.prompts, args.json, args.budget_png)


def _export_command(args: argparse.Namespace) -> int:
    from launch.export import export_command

    return export_command(
        args.run_dir, args.out, args.step, args.shard_size, args.force, LoraExport(args.lora)
    )


def _report_command(args: argparse.Namespace) -> int:
    from launch.report import report_command

    return report_command(args.run_dir, args.out)


def _ray_wait_command(args: argparse.Namespace) -> int:
    from launch.slurm_cmds import wait_for_ray

    return wait_for_ray(args.address, args.nodes, args.timeout)


COMMANDS = {
    "config": _config_command,
    "train": _train_command,
    "sft": _train_command,
    "submit": _submit_command,
    "plan": _plan_command,
    "make-model": _make_model_command,
    "status": _slurm_command,
    "logs": _slurm_command,
    "cancel": _slurm_command,
    "ray-wait": _ray_wait_command,
    "diagnose": _diagnose_command,
    "report": _report_command,
    "export": _export_command,
}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse; `key=value` overrides may also follow options (`train R --resume DIR a.b=1`)."""
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    unknown = [item for item in extra if item not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    # Ctrl-C (SIGINT) always stops a command cleanly, also where it started ignored, as in a script's
    # background job (`moe-rl train ... &`, the sbatch script's driver); a run's steps take it over
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    args = _parse(argv)
    setup_logging(args.log_level or "INFO")
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:  # a recipe, dataset row, stored trajectory or reward function: one line
        log.error("%s", exc)
        return 2
    except OSError as exc:  # a full disk, a read-only or forbidden path: one line, naming it
        fault = user_error_of(exc)
        if fault is None:
            raise
        log.error("%s", fault)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C before a run's steps (they stop on their own terms)
        log.warning("%s", str(exc) or "interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
