"""One logging format for the whole project, and rich progress bars for long work."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress

LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


def setup_logging(level: str | int = "INFO") -> None:
    """Configure the root logger once (idempotent): `HH:MM:SS L module: message` on stderr."""
    root = logging.getLogger()
    if not any(getattr(h, "_moe_rl", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        handler._moe_rl = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)


def log_to_file(path: str | os.PathLike[str]) -> logging.Logger:
    """Copy every project message to ``path`` (appended), and return a logger that writes there
    only: for tracebacks the terminal should not show."""
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S"))
    logging.getLogger().addHandler(handler)
    trace = logging.getLogger("moe_rl.trace")
    trace.propagate = False
    trace.handlers = [handler]
    return trace


def progress(enabled: bool = True) -> Progress:
    """A progress display for loops over steps, samples or tokens (disabled off a terminal in CI)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    disable = not enabled or os.environ.get("CI") == "true" or not sys.stderr.isatty()
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        disable=disable,
        transient=False,
    )
