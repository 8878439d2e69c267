"""`moe-rl report`: plots and a markdown summary of a run directory's `metrics.jsonl`."""

from __future__ import annotations

import logging
from pathlib import Path

from moe_rl.config import ConfigError

log = logging.getLogger("moe_rl.report")


def report_command(run_dir: str, out: str | None = None) -> int:
    folder = Path(run_dir)
    if not (folder / "metrics.jsonl").is_file():
        raise ConfigError(f"RUN_DIR={run_dir}: no metrics.jsonl; expected a run directory of `moe-rl train`")
    from moe_rl.diagnostics.report import write_report

    written = write_report(folder, Path(out) if out else None)
    log.info("wrote %s", ", ".join(str(p) for p in written))
    return 0
