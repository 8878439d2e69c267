"""The `moe-rl` command line. Parses and validates before importing anything heavy, so a bad recipe
fails in a second rather than after Megatron loads."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from moe_rl.config import ConfigError, load_recipe
from moe_rl.log import setup_logging

log = logging.getLogger("moe_rl.cli")


def _add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny_moe.yaml")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. trainer.lr=2e-6")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-rl", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run the RL job of a recipe")
    _add_recipe_args(train)
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")

    config = sub.add_parser("config", help="inspect recipes")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved recipe as YAML")
    _add_recipe_args(show)
    check = config_sub.add_parser("check", help="load and validate recipes; print OK or the error")
    check.add_argument("recipes", nargs="+", help="recipe YAML files")
    return parser


def _config_command(args: argparse.Namespace) -> int:
    from moe_rl.config import to_yaml

    if args.config_command == "show":
        sys.stdout.write(to_yaml(load_recipe(args.recipe, args.overrides)))
        return 0
    failed = 0
    for recipe in args.recipes:
        try:
            load_recipe(recipe)
            sys.stdout.write(f"OK    {recipe}\n")
        except ConfigError as exc:
            failed += 1
            sys.stdout.write(f"FAIL  {recipe}: {exc}\n")
    return 1 if failed else 0


def _train_command(args: argparse.Namespace) -> int:
    from launch.train import train

    return train(args.recipe, args.overrides, resume=args.resume)


COMMANDS = {"config": _config_command, "train": _train_command}


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    setup_logging(args.log_level.upper())
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
