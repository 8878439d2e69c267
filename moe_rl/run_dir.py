"""A run directory belongs to one run: its lock, its checkpoints and what proves them complete.

* **Ownership.** `RunLock` holds an exclusive ``flock`` on the run directory itself for the run's
  life; the operating system releases it when the process ends, however it ends, so a lock left by
  a dead process is never in the way (it is reported, from the owner ``run.lock`` names, and taken
  over). ``run.lock`` only says who holds the run: deleting or replacing it takes nothing away, and
  the owner writes it again. Before each metrics line and each checkpoint the owner checks that the
  directory is still the one it locked (`ensure_owned`), so a run whose directory was moved or
  replaced stops rather than write into another run's.
  `claim` refuses a directory that already holds a run unless the user resumes it or asks to start
  over (``--force-new``), and refuses to start over a directory the run is told to start from.
* **Checkpoints that prove themselves.** A checkpoint ``checkpoints/step_NNNNNN/`` is complete only
  when its ``manifest.json`` (size and CRC-32 of every file in it) exists; it is written last, and
  atomically (a temporary file renamed). `newest_usable` scans ``checkpoints/`` (``latest`` is only a
  hint), verifies the newest checkpoint against its manifest and falls back to older ones, saying
  why each newer one was skipped; a save that never finished (no manifest: a stop, a full disk) was
  never a checkpoint, and with none sealed a resume starts from step 0. A ``checkpoints/`` that is
  there but cannot be read (a symbolic link loop, a link to storage that is gone) is an error
  naming it, never "no checkpoint yet": that would start over and rewrite the run's metrics.
* **A full disk** (`writing`, `disk_full`): a write into the run directory that the machine refuses
  is one line naming the file, and what a resume will do.
* **Its metrics.** `read_metrics` reads ``metrics.jsonl`` back (a torn last line, a write cut
  short, is reported and dropped).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_rl.errors import FAULTS, ConfigError, EnvironmentFault, UserError

log = logging.getLogger("moe_rl.run_dir")

LOCK = "run.lock"
MANIFEST = "manifest.json"
METRICS = "metrics.jsonl"
CHECKPOINT = re.compile(r"step_(\d{6,})")
RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "tensorboard", "trajectories", "offline_data", "config.yaml")
"""What a run writes into its directory (``--force-new`` removes these; logs stay)."""


class RunDirInUse(ConfigError):
    """Another live process holds the run directory."""


class RunDirLost(ConfigError):
    """The run directory this process locked was moved or replaced while it ran."""


_HELD: dict[Path, RunLock] = {}
"""The run directories this process holds, by resolved path (`ensure_owned`)."""


class RunLock:
    """An exclusive lock on a run directory for this process's life (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)
        self.path = self.dir / LOCK
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None
        self.owner = ""

    def acquire(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            owner = self._written() or "another process (its run.lock was removed)"
            raise RunDirInUse(
                f"run directory {self.dir} is in use by {owner}; wait for that run to end, stop it, "
                "or choose another run.name"
            ) from None
        previous = self._written()
        if previous:
            log.warning("run directory %s: the previous run (%s) ended without releasing it; taking it over",
                        self.dir, previous)  # fmt: skip
        stat = os.fstat(fd)
        self._fd, self._identity = fd, (stat.st_dev, stat.st_ino)
        self.owner = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        self._write(self.owner)
        _HELD[self.dir.resolve()] = self

    def _written(self) -> str:
        try:
            return self.path.read_text().strip()
        except (FileNotFoundError, IsADirectoryError):
            return ""

    def _write(self, text: str) -> None:
        tmp = self.path.with_name(f".{LOCK}.{os.getpid()}")
        tmp.write_text(f"{text}\n" if text else "")
        os.replace(tmp, self.path)

    def check(self) -> None:
        """Raise `RunDirLost` if the directory is no longer the one locked; write ``run.lock`` again
        if it was removed or replaced."""
        if self._fd is None:
            return
        try:
            stat = os.stat(self.dir)
            same = (stat.st_dev, stat.st_ino) == self._identity
        except FileNotFoundError:
            same = False
        if not same:
            raise RunDirLost(
                f"run directory {self.dir} was moved or replaced while this run held it; the run stops so "
                "that it never writes into another run's directory"
            )
        if self._written() != self.owner:
            log.warning("run directory %s: run.lock was removed or changed; this run (%s) still holds the "
                        "directory and wrote it again", self.dir, self.owner)  # fmt: skip
            self._write(self.owner)

    def release(self) -> None:
        if self._fd is not None:
            _HELD.pop(self.dir.resolve(), None)
            with contextlib.suppress(OSError):  # a clean end: nothing to report next time
                if self._written() == self.owner:
                    self._write("")
            os.close(self._fd)  # the flock goes with it
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


FULL_BYTES = 64 << 20
"""Free bytes under which a failed write is taken for a full disk (`disk_full`)."""
AFTER_A_FULL_DISK = (
    "what the run wrote before stays intact: with space freed, --resume continues from the newest "
    "sealed checkpoint (from step 0 when there is none; an unsealed one is skipped)"
)


def disk_full(path: Path, writing: str, said: bool = False) -> UserError | None:
    """After a write under ``path`` failed: a one-line `EnvironmentFault` when its device is full,
    as the operating system ``said`` (ENOSPC) or as its free space shows (libraries may report it in
    their own words, e.g. "unexpected pos" from a zip writer)."""
    try:
        free = shutil.disk_usage(_nearest_existing(Path(path))).free
    except OSError:
        free = None
    if not said and (free is None or free >= FULL_BYTES):
        return None
    room = "" if free is None else f" ({free / 2**20:.0f} MiB free)"
    return EnvironmentFault(
        f"{path}: no space left on the device{room} while writing {writing}; {AFTER_A_FULL_DISK}"
    )


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextlib.contextmanager
def writing(path: Path, what: str) -> Iterator[None]:
    """Around a write of ``what`` into ``path``: a full device (`disk_full`) or another refusal of
    the machine (`moe_rl.errors.FAULTS`) becomes one `EnvironmentFault` naming ``path`` (the
    ``OSError`` of a write to an open file names none); anything else is raised as it is."""
    try:
        yield
    except (UserError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # torch's CheckpointException, a failed save, is a BaseException
        code = exc.errno if isinstance(exc, OSError) else None
        fault = disk_full(path, what, said=code == errno.ENOSPC)
        if fault is None and code in FAULTS:
            named = getattr(exc, "filename", None) or path
            fault = EnvironmentFault(f"{named}: {FAULTS[code]} while writing {what}")
        if fault is None:
            raise
        raise fault from exc


def ensure_owned(run_dir: Path) -> None:
    """Before a write into ``run_dir``: if this process holds it (`RunLock`), check it still does."""
    lock = _HELD.get(Path(run_dir).resolve())
    if lock is not None:
        lock.check()


def holds_a_run(run_dir: Path) -> bool:
    return any(os.path.lexists(Path(run_dir) / name) for name in ("metrics.jsonl", "checkpoints"))


def claim(run_dir: Path, force_new: bool, starts_from: str | None = None) -> None:
    """Make ``run_dir`` ready for a new run (its lock already held): refuse one that holds a run,
    unless ``force_new``, which removes that run's files (logs stay), and refuse that too when the
    run is to start from a checkpoint in it (``starts_from``, `model.init_from`). Nothing is removed
    before every check passed (a ``checkpoints/`` that cannot be read is one)."""
    if not holds_a_run(run_dir):
        return
    steps = [step for step, _ in checkpoints(run_dir)]
    if not force_new:
        saved = f"checkpoints of steps {sorted(steps)}" if steps else "no checkpoint"
        raise ConfigError(
            f"run directory {run_dir} already holds a run ({saved}); continue it with "
            f"`moe-rl train --resume {run_dir}`, start it over with --force-new (deletes its checkpoints "
            "and metrics), or choose another run.name"
        )
    if starts_from is not None and _within(Path(starts_from), Path(run_dir)):
        raise ConfigError(
            f"model.init_from={starts_from} (--init-from) is in {run_dir}, whose checkpoints --force-new "
            "deletes before the run would start from them; give the new run another run.name, or copy "
            "the checkpoint out of the directory first"
        )
    log.warning("--force-new: removing the earlier run's checkpoints and metrics from %s", run_dir)
    for name in RUN_ARTIFACTS:
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()  # a file, or a link (what it points to stays)


def take_new(run_dir: Path, recipe: str, force_new: bool, starts_from: str | None = None) -> None:
    """A new run's directory (its lock already held): `claim`, then its resolved ``recipe`` (YAML)
    written as ``config.yaml``, which `--resume` reads back."""
    claim(run_dir, force_new, starts_from)
    with writing(Path(run_dir) / "config.yaml", "the run's recipe"):
        (Path(run_dir) / "config.yaml").write_text(recipe)


def unclaim(run_dir: Path, made: bool) -> str:
    """Undo a new run stopped before its first step (a Ctrl-C while it started; its lock still
    held), so that no half-made run is left: the directory goes when this run ``made`` it, else the
    config.yaml it wrote there (which `--resume` would take for a run). A directory holding a
    metrics line or a checkpoint is left alone. Returns what was done, in words."""
    if holds_a_run(run_dir):
        return f"{run_dir} holds what the run wrote"
    if made:
        shutil.rmtree(run_dir, ignore_errors=True)
        return f"removed the run directory {run_dir}"
    (Path(run_dir) / "config.yaml").unlink(missing_ok=True)
    return f"nothing of the run is left in {run_dir}"


def _within(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


UNREADABLE = {
    errno.ELOOP: "a symbolic link loop",
    errno.ENOTDIR: "not a folder",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
"""How `_names` says why a folder cannot be listed."""


def _names(folder: Path) -> list[str]:
    """The entries of ``folder``; none when nothing is at its path. Something there that cannot be
    read as a folder (a symbolic link loop, a link to storage that is gone, a file, a folder this
    process may not read) is an `EnvironmentFault` naming it: taken for "no checkpoint yet", a
    resume would start over from step 0 and rewrite the run's metrics."""
    try:
        return sorted(os.listdir(folder))
    except FileNotFoundError:
        if not os.path.islink(folder):
            return []
        why = f"a link to {os.readlink(folder)}, which is not there"
    except OSError as exc:
        why = UNREADABLE.get(exc.errno) or str(exc.strerror or exc).lower()
    raise EnvironmentFault(
        f"{folder}: cannot be read ({why}); the run's checkpoints may be behind it: make it readable, "
        "or move it away to go on without them"
    )


# --------------------------------------------------------------------------------- checkpoints
def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(ckpt: Path) -> list[Path]:
    return sorted(
        p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp")
    )


def write_manifest(ckpt: Path) -> None:
    """Seal a checkpoint: sizes and CRC-32 of its files, written last and atomically."""
    files = {str(p.relative_to(ckpt)): {"bytes": p.stat().st_size, "crc32": _crc32(p)} for p in _files(ckpt)}
    tmp = ckpt / f"{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)


def verify(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from (None: complete and intact)."""
    manifest = ckpt / MANIFEST
    if not manifest.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return f"manifest.json is unreadable ({exc})"
    for name, want in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes, the manifest says {want['bytes']}"
        if _crc32(path) != want["crc32"]:
            return f"{name} does not match its checksum (damaged)"
    return None


@dataclass(frozen=True)
class Usable:
    path: Path
    step: int


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoints/step_NNNNNN`` of ``run_dir``, newest first."""
    folder = Path(run_dir) / "checkpoints"
    found = ((int(m.group(1)), folder / m.group(0)) for m in map(CHECKPOINT.fullmatch, _names(folder)) if m)
    return sorted(found, reverse=True)


def newest_usable(run_dir: Path) -> Usable | None:
    """The newest complete, intact checkpoint under ``run_dir/checkpoints`` (None: none was ever
    sealed). Newer ones that fail verification are reported and skipped. A save that never finished
    (`unsealed`) was never a checkpoint: with nothing older, the run starts from step 0. But when
    every sealed one fails, that is an error (resuming from step 0 would overwrite them)."""
    folder = Path(run_dir) / "checkpoints"
    skipped = []
    for step, path in checkpoints(run_dir):
        problem = verify(path)
        if problem is None:
            for name, why in skipped:
                log.warning(
                    "checkpoint %s is not usable (%s); resuming from the older %s", name, why, path.name
                )
            _check_hint(folder, path.name)
            return Usable(path, step)
        skipped.append((path.name, problem))
    if any(not unsealed(folder / name) for name, _ in skipped):
        reasons = "; ".join(f"{name}: {why}" for name, why in skipped)
        raise ConfigError(
            f"--resume {run_dir}: no usable checkpoint ({reasons}); start over with --force-new or fix the files"
        )
    for name, why in skipped:
        log.warning("checkpoint %s is not usable (%s); no checkpoint was sealed before it", name, why)
    return None


def unsealed(ckpt: Path) -> bool:
    """Whether ``ckpt`` is a save that never finished (a readable folder without a manifest: the run
    stopped or the disk filled while it saved), rather than a sealed checkpoint now damaged."""
    try:
        return MANIFEST not in os.listdir(ckpt)
    except OSError:
        return False


@dataclass(frozen=True)
class Resume:
    """Where a resumed run continues, decided once before anything starts: from ``checkpoint``
    (`newest_usable`), or from step 0 when none was sealed (None)."""

    checkpoint: Usable | None


def init_checkpoint(path: Path, key: str | None = None) -> Path:
    """The trainer state a run starts from (`model.init_from`, `critic.init_from`: ``key`` names
    it, the first by default): ``path`` is one checkpoint folder (complete and intact), or a run
    directory whose newest usable checkpoint is taken."""
    key = key or f"model.init_from={path}"
    if (path / "trainer").is_dir():
        problem = verify(path)
        if problem is not None:
            raise UserError(f"{key}: the checkpoint is not usable: {problem}")
        return path / "trainer"
    if not os.path.lexists(path / "checkpoints"):  # there but unreadable: `newest_usable` says why
        raise UserError(
            f"{key}: neither a run directory with checkpoints/ nor a checkpoint folder with trainer/"
        )
    try:
        usable = newest_usable(path)
    except ConfigError as exc:
        raise UserError(f"{key}: {str(exc).split(': ', 1)[-1]}") from None
    if usable is None:
        raise UserError(f"{key}: the run has no checkpoint yet")
    return usable.path / "trainer"


def sealed(run_dir: Path) -> list[Path]:
    """The checkpoints of ``run_dir`` that were sealed (their manifest written), oldest first; not
    verified against it (`newest_usable` does that)."""
    return [path for _, path in reversed(checkpoints(run_dir)) if (path / MANIFEST).is_file()]


def _check_hint(folder: Path, chosen: str) -> None:
    latest = folder / "latest"
    hint = latest.read_text().strip() if latest.is_file() else None
    if hint != chosen:
        log.warning(
            "checkpoints/latest says %s; resuming from %s, the newest usable checkpoint", hint, chosen
        )


def mark_latest(folder: Path, name: str) -> None:
    """Point ``checkpoints/latest`` at ``name`` (atomically; a hint for people and tools)."""
    tmp = folder / "latest.tmp"
    tmp.write_text(name)
    os.replace(tmp, folder / "latest")


def set_aside_newer(folder: Path, step: int) -> None:
    """Checkpoints after ``step`` (unusable ones a resume skipped) are renamed ``<name>.unusable-<time>``:
    kept for a look, no longer taken for checkpoints, and out of the way of the steps run again."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in _names(folder):
        m = CHECKPOINT.fullmatch(name)
        if m and int(m.group(1)) > step:
            os.replace(folder / name, folder / f"{name}.unusable-{stamp}")
            log.warning("set aside checkpoint %s as %s.unusable-%s", name, name, stamp)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl`, in order."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        raise ValueError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    return read_records(path)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of ``path``, one per line. A torn last line (a write cut short by a crash)
    is reported and dropped; a bad line elsewhere is an error naming it."""
    lines = path.read_bytes().split(b"\n")
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a step record")
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            if all(not rest.strip() for rest in lines[number:]):
                log.warning("%s: line %d is incomplete (a write cut short); dropped", path, number)
                break
            raise ValueError(f"{path}: line {number} is not a metrics record ({exc}): {raw[:80]!r}") from None
        records.append(record)
    return records
