"""One logging format for the whole project, and rich progress bars for long work.

A run keeps the terminal for its own messages: library messages (Megatron, Ray, vLLM, ModelOpt,
PyTorch, …) and Python warnings go to the run's log files only, `logs/train.log` for the driver
and `logs/<actor>.log` for each Ray actor, unless `logging.verbose` or level DEBUG asks for them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from moe_rl.errors import FAULTS

if TYPE_CHECKING:
    from rich.progress import Progress

LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
PROJECT_LOGGERS = ("moe_rl", "launch", "__main__")
"""Top-level names of the project's loggers; every other logger is a library's."""
OWN_HANDLERS = ("ray", "vllm")
"""Libraries that print through handlers of their own; `route_library_logs` sends them through the
root logger instead."""
LOG_DIR_ENV = "MOE_RL_LOG_DIR"
"""The run's `logs/` folder, set by the driver for every Ray actor of the run."""


class _Stderr(logging.StreamHandler):
    """Writes to `sys.stderr` as it is at each message: a progress display replaces it while it runs,
    to print messages above its bar rather than over it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Shown(logging.Filter):
    """What the terminal shows when quiet: the project's messages from ``level`` up, and errors of
    anyone (a library's error usually comes with the one that stops the run)."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        return record.name.partition(".")[0] in PROJECT_LOGGERS and record.levelno >= self.level


def setup_logging(
    level: str | int = "INFO", quiet: bool = False, terminal_level: str | int | None = None
) -> None:
    """Configure the root logger (idempotent): `HH:MM:SS L module: message` on stderr. ``quiet``
    keeps library messages and warnings off the terminal (log files still get them, see
    `log_to_file`) and shows the project's from ``terminal_level`` (default ``level``) up."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if getattr(h, "_moe_rl", False)), None)
    if handler is None:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        handler._moe_rl = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    for old in [f for f in handler.filters if isinstance(f, _Shown)]:
        handler.removeFilter(old)
    if quiet:
        shown = root.level if terminal_level is None else _number(terminal_level)
        handler.addFilter(_Shown(max(root.level, shown)))


def _number(level: str | int) -> int:
    number = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"log level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    return number


def shows_libraries(level: str | int, verbose: bool) -> bool:
    """Whether library output belongs on the terminal: `logging.verbose`, or level DEBUG."""
    return verbose or _number(level) <= logging.DEBUG


class _LogFile(logging.FileHandler):
    """A log file (made at its first message). A write the machine refuses (a full disk) is said
    once, in one line on the terminal, instead of logging's "--- Logging error ---" and a traceback
    at every message; the messages go on to the terminal as before, and to the file again once it
    takes them."""

    def __init__(self, path: Path):
        super().__init__(path, encoding="utf-8", delay=True)  # no empty files
        self.refused = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)
        except OSError:  # opening the file (its first message) is outside logging's own guard
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        if not self.refused:
            self.refused = True
            cause = FAULTS.get(exc.errno) or exc.strerror or str(exc)
            said = logging.LogRecord("moe_rl.log", logging.WARNING, __file__, 0, "%s: %s; %s", (
                self.baseFilename, cause, "the messages from here on miss from this file",
            ), None)  # fmt: skip
            for handler in logging.getLogger().handlers:
                if getattr(handler, "_moe_rl", False):  # the terminal (`setup_logging`)
                    handler.handle(said)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the last write fails too; said already
            super().close()


def log_to_file(path: str | os.PathLike[str]) -> logging.Logger:
    """Copy every message (the project's and the libraries') to ``path`` (appended), and return a
    logger that writes there only: for tracebacks the terminal should not show."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = _LogFile(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, "%Y-%m-%d %H:%M:%S"))
    logging.getLogger().addHandler(handler)
    trace = logging.getLogger("moe_rl.trace")
    trace.propagate = False
    trace.handlers = [handler]
    return trace


def close_log_file(path: str | os.PathLike[str]) -> None:
    """Stop copying messages to ``path`` (`log_to_file`), e.g. before its folder is removed."""
    root, trace = logging.getLogger(), logging.getLogger("moe_rl.trace")
    for handler in [h for h in root.handlers if isinstance(h, _LogFile)]:
        if handler.baseFilename == os.path.abspath(path):
            root.removeHandler(handler)
            trace.handlers = [h for h in trace.handlers if h is not handler]
            handler.close()


class _Trimmed(logging.Filter):
    """A captured warning without the blank line that `warnings.formatwarning` ends it with."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = record.getMessage().rstrip(), ()
        return True


def route_library_logs() -> None:
    """Python warnings (`warnings.warn`) and the loggers of libraries already imported that print
    through handlers of their own (`OWN_HANDLERS`) go through the root logger, whose handlers decide
    where they appear. Call it after importing Ray: Ray adds its handler when imported."""
    logging.captureWarnings(True)
    warnings = logging.getLogger("py.warnings")
    if not any(isinstance(f, _Trimmed) for f in warnings.filters):
        warnings.addFilter(_Trimmed())
    for name in OWN_HANDLERS:
        if name in sys.modules:
            logger = logging.getLogger(name)
            logger.handlers.clear()
            logger.propagate = True


@contextlib.contextmanager
def libraries_to_file(path: Path) -> Iterator[Path]:
    """For a one-shot command (`export`, `diagnose`), while it works: the terminal keeps the
    project's messages, and library messages and Python warnings go to ``path`` (made on the first
    message), unless the level is DEBUG, which shows them on the terminal too. At the end, whatever
    happened, the file is named when there is one, and the logging is as it was."""
    root, trace = logging.getLogger(), logging.getLogger("moe_rl.trace")
    level, handlers, trace_state = root.level, list(root.handlers), (trace.propagate, list(trace.handlers))
    setup_logging(level, quiet=not shows_libraries(level, False))
    log_to_file(path)
    route_library_logs()
    try:
        yield path
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
            handler.close()
        trace.propagate, trace.handlers = trace_state
        setup_logging(level)
        logging.captureWarnings(False)
        if path.is_file():
            logging.getLogger("moe_rl.log").info("library messages and warnings: %s", path)


def quiet_vllm(path: Path, level: str | int) -> None:
    """Send vLLM's messages to ``path`` only, in this process and in the engine processes vLLM starts
    (through `VLLM_LOGGING_CONFIG_PATH`, read when vLLM is imported); a vLLM logging setup of the
    user's own is kept."""
    if "VLLM_LOGGING_CONFIG_PATH" in os.environ or "VLLM_CONFIGURE_LOGGING" in os.environ:
        return
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"moe_rl": {"format": LOG_FORMAT, "datefmt": "%Y-%m-%d %H:%M:%S"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(path), "formatter": "moe_rl"}},
        "loggers": {"vllm": {"handlers": ["file"], "level": _number(level), "propagate": False}},
    }
    spec = path.with_name(f".{path.stem}.vllm-logging.json")
    spec.write_text(json.dumps(config, indent=1))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(spec)


def setup_actor_logging(name: str, level: str | int, verbose: bool) -> None:
    """A Ray actor's logging. In a run (`LOG_DIR_ENV` set) everything goes to `<logs>/<name>.log`,
    and the actor's stderr, which Ray forwards to the driver's terminal, gets only the project's
    warnings and errors, unless the libraries are shown (`shows_libraries`). Outside a run, all of it
    goes to stderr."""
    folder = os.environ.get(LOG_DIR_ENV)
    quiet = folder is not None and not shows_libraries(level, verbose)
    setup_logging(level, quiet=quiet, terminal_level="WARNING")
    if folder is None:
        return
    path = Path(folder) / f"{name}.log"
    log_to_file(path)
    route_library_logs()
    if quiet:
        quiet_vllm(path, level)


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
