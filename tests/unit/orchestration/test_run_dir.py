"""A run directory belongs to one run: its lock, refusal of a directory holding a run, checkpoints
sealed by a manifest and verified on resume, metrics files with a torn last line."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl import run_dir as rd
from moe_rl.config import ConfigError
from moe_rl.orchestration.metrics import MetricsSink
from moe_rl.run_dir import read_metrics

REPO = Path(__file__).resolve().parents[3]
HOLD = (
    "import sys, time\n"
    "from moe_rl.run_dir import RunLock\n"
    "lock = RunLock(sys.argv[1])\n"
    "lock.acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(60)\n"
)


def _holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    ready, _, _ = select.select([proc.stdout], [], [], 60)  # the child says "held" once it holds
    assert ready, "the lock holder said nothing in 60 s"
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_owner_is_refused_and_a_dead_one_reported(tmp_path, caplog):
    owner = _holder(tmp_path)
    with pytest.raises(rd.RunDirInUse, match=rf"in use by pid {owner.pid} on .*choose another run.name"):
        rd.RunLock(tmp_path).acquire()
    owner.send_signal(signal.SIGKILL)  # dies holding it: the OS releases the lock, its note stays
    owner.wait()
    with caplog.at_level(logging.WARNING), rd.RunLock(tmp_path):
        assert f"pid {os.getpid()}" in (tmp_path / rd.LOCK).read_text()
    assert f"previous run (pid {owner.pid}" in caplog.text and "taking it over" in caplog.text
    assert (tmp_path / rd.LOCK).read_text() == ""  # a clean end leaves nothing to report
    with rd.RunLock(tmp_path), pytest.raises(rd.RunDirInUse):  # one process: a second lock is refused too
        rd.RunLock(tmp_path).acquire()


def test_deleting_or_replacing_run_lock_takes_nothing_from_its_owner(tmp_path, caplog):
    """The directory itself is locked: with ``run.lock`` deleted, or replaced by another file, a
    second run is still refused, and the owner's next metrics write puts its note back, with a
    warning, whether it was deleted or holds another owner's text. A directory moved away and
    replaced under its name stops the owner's next write with one line."""
    owner = _holder(tmp_path)
    try:
        (tmp_path / rd.LOCK).unlink()
        with pytest.raises(rd.RunDirInUse, match=r"in use by another process \(its run.lock was removed\)"):
            rd.RunLock(tmp_path).acquire()
        (tmp_path / rd.LOCK).write_text("pid 1 on elsewhere\n")
        with pytest.raises(
            rd.RunDirInUse, match="in use by pid 1 on elsewhere"
        ):  # the note lies; the lock holds
            rd.RunLock(tmp_path).acquire()
    finally:
        owner.kill()
        owner.wait()
    run = tmp_path / "run"
    with rd.RunLock(run) as lock:
        sink = MetricsSink(run, tensorboard=False)
        (run / rd.LOCK).unlink()
        with caplog.at_level(logging.WARNING):
            sink.log(0, {"reward/mean": 0.5})
        assert (run / rd.LOCK).read_text().strip() == lock.owner and "wrote it again" in caplog.text
        caplog.clear()
        (run / rd.LOCK).write_text("pid 1 on elsewhere\n")  # there, but another owner's note
        with caplog.at_level(logging.WARNING):
            sink.log(1, {"reward/mean": 0.55})
        assert (run / rd.LOCK).read_text().strip() == lock.owner and "wrote it again" in caplog.text
        run.rename(tmp_path / "moved")
        run.mkdir()  # another directory under the run's name
        with pytest.raises(rd.RunDirLost, match=f"run directory {run} was moved or replaced"):
            sink.log(2, {"reward/mean": 0.6})
    assert [r["step"] for r in read_metrics(tmp_path / "moved")] == [0, 1]
    assert not (run / "metrics.jsonl").exists()


def test_a_directory_holding_a_run_is_refused_unless_started_over(tmp_path):
    rd.claim(tmp_path, force_new=False)  # empty: fine
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "checkpoints" / "step_000003").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "train.log").write_text("kept")
    with pytest.raises(ConfigError) as err:
        rd.claim(tmp_path, force_new=False)
    assert str(err.value) == (
        f"run directory {tmp_path} already holds a run (checkpoints of steps [1, 3]); continue it with "
        f"`moe-rl train --resume {tmp_path}`, start it over with --force-new (deletes its checkpoints and "
        "metrics), or choose another run.name"
    )
    rd.claim(tmp_path, force_new=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]


def _checkpoint(folder: Path, step: int, payload: bytes = b"x" * 10000) -> Path:
    ckpt = folder / f"step_{step:06d}"
    (ckpt / "trainer").mkdir(parents=True)
    (ckpt / "trainer" / "__0_0.distcp").write_bytes(payload)
    (ckpt / "driver.json").write_text(json.dumps({"step": step}))
    rd.write_manifest(ckpt)
    rd.mark_latest(folder, ckpt.name)
    return ckpt


@pytest.mark.parametrize("damage", ["truncated", "overwritten", "manifest missing", "file missing"])
def test_resume_falls_back_from_a_damaged_newest_checkpoint(tmp_path, caplog, damage):
    folder = tmp_path / "checkpoints"
    _checkpoint(folder, 1)
    newest = _checkpoint(folder, 3)
    data = newest / "trainer" / "__0_0.distcp"
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[:5000])
    elif damage == "overwritten":  # same size, 4 KiB of other bytes
        with open(data, "r+b") as f:
            f.seek(1000)
            f.write(b"\0" * 4096)
    elif damage == "manifest missing":  # the save was cut before its seal
        (newest / rd.MANIFEST).unlink()
    else:
        data.unlink()
    with caplog.at_level(logging.WARNING):
        usable = rd.newest_usable(tmp_path)
    assert usable == rd.Usable(folder / "step_000001", 1)
    reason = {"truncated": "has 5000 bytes, the manifest says 10000", "overwritten": "does not match its checksum",
              "manifest missing": "no manifest.json", "file missing": "is missing"}[damage]  # fmt: skip
    assert "checkpoint step_000003 is not usable (" in caplog.text and reason in caplog.text
    assert "resuming from the older step_000001" in caplog.text
    rd.set_aside_newer(folder, usable.step)
    (aside,) = [p.name for p in folder.iterdir() if p.name.startswith("step_000003")]
    assert aside.startswith("step_000003.unusable-")
    assert rd.newest_usable(tmp_path).step == 1


def test_latest_is_a_hint_and_all_damaged_is_an_error(tmp_path, caplog):
    folder = tmp_path / "checkpoints"
    assert rd.newest_usable(tmp_path) is None  # nothing saved yet: start from step 0
    _checkpoint(folder, 1)
    _checkpoint(folder, 3)
    (folder / "latest").unlink()
    with caplog.at_level(logging.WARNING):
        assert rd.newest_usable(tmp_path).step == 3
    assert "checkpoints/latest says None; resuming from step_000003" in caplog.text
    for step in (1, 3):
        (folder / f"step_{step:06d}" / "driver.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no usable checkpoint \(step_000003: driver.json has 2 bytes"):
        rd.newest_usable(tmp_path)


def test_a_torn_last_metrics_line_is_dropped_and_a_torn_middle_line_named(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a"')
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert "line 3 is incomplete (a write cut short); dropped" in caplog.text
    sink = MetricsSink(tmp_path, tensorboard=False)
    sink.resume_from(1)
    assert path.read_text() == '{"step": 0, "a": 1}\n'
    path.write_text('{"step": 0}\n{"ste\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a metrics record"):
        read_metrics(tmp_path)


def test_train_refuses_a_taken_run_name_before_anything_starts(tmp_path):
    run = tmp_path / "taken"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", "recipes/tiny_moe.yaml", f"run.output_dir={tmp_path}",
         "run.name=taken"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if " E " in x]
    assert "already holds a run (no checkpoint)" in line and "--force-new" in line
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'
    # refused before the run began: no config.yaml written, no logs/ (the run's first file), and the
    # lock it took released clean
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", rd.LOCK]
    assert (run / rd.LOCK).read_text() == ""
    both = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", "x.yaml", "--resume", str(run), "--force-new"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert both.returncode == 2 and "give one of them" in both.stderr


def test_a_full_disk_is_said_as_such_and_an_os_refusal_names_its_path(tmp_path, monkeypatch):
    """Libraries report a full disk in their own words ("unexpected pos 704 vs 598"): after a failed
    write the run looks at the device and says "no space left"; the operating system's refusals
    (ENOSPC, EROFS, EACCES, ...) become one line with the path."""
    import errno
    import shutil

    from moe_rl.errors import EnvironmentFault, user_error_of

    assert rd.disk_full(tmp_path, "checkpoint step_000003") is None  # room left: not the disk
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=3 << 20))
    full = rd.disk_full(tmp_path, "checkpoint step_000003")
    assert isinstance(full, EnvironmentFault)
    assert str(full).startswith(
        f"{tmp_path}: no space left on the device (3 MiB free) while writing checkpoint"
    )
    wrapped = RuntimeError("a task failed")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system", "/data/runs/x")
    assert str(user_error_of(wrapped)) == "/data/runs/x: the file system is read-only"
    assert user_error_of(OSError(errno.EBADF, "Bad file descriptor")) is None  # a bug, not the machine
