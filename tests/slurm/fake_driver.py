"""A stand-in for `moe-rl train` in the Slurm tests: `fake_driver.py --marker FILE --mode MODE
CONFIG [--resume RUN_DIR]` appends one line per event to FILE.

Mode `hold` (the only one): it records the start and waits; SIGINT (what the sbatch script sends
before a requeue) records a checkpoint and exits 130; a resumed start (`--resume`) records the
resume and exits 0, or, before restart `--hold-until-restart N` (default 0), waits as a start does.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def _record(marker: Path, event: str, args: argparse.Namespace) -> None:
    fields = {
        "event": event,
        "config": args.config,
        "resume": args.resume or "",
        "restarts": os.environ.get("SLURM_RESTART_COUNT", "0"),
        "ray": os.environ.get("RAY_ADDRESS", ""),
        "wandb_key": "set" if os.environ.get("WANDB_API_KEY") else "unset",
        "ray_token": "set" if os.environ.get("RAY_AUTH_TOKEN") else "unset",
    }
    with marker.open("a") as f:
        f.write("|".join(f"{k}={v}" for k, v in fields.items()) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--marker", type=Path, required=True)
    parser.add_argument("--mode", choices=("hold",), default="hold")
    parser.add_argument("config")
    parser.add_argument("--resume")
    parser.add_argument("--hold-until-restart", type=int, default=0)
    args = parser.parse_args()
    if args.resume:
        _record(args.marker, "resume", args)
        if int(os.environ.get("SLURM_RESTART_COUNT", "0")) >= args.hold_until_restart:
            return 0
    else:
        _record(args.marker, "start", args)
    try:
        time.sleep(600)
    except KeyboardInterrupt:
        _record(args.marker, "checkpoint", args)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
