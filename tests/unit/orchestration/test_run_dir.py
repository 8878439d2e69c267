"""A run directory belongs to one run: its lock, refusal of a directory holding a run, checkpoints
sealed by a manifest and verified on resume, metrics files with a torn last line."""

from __future__ import annotations

import errno
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
from moe_rl.errors import UserError
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


# ----------------------------------------------------------------- what resume and start-from read
TINY = "recipes/tiny_moe.yaml"


def _cli_train(*args: str) -> str:
    """`moe-rl train` refusing: its one error line (no traceback, exit code 2)."""
    out = subprocess.run(
        [sys.executable, "-m", "launch.cli", "train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (line,) = [x for x in out.stderr.splitlines() if " E " in x]
    return line


def _a_run(folder: Path) -> Path:
    """A run directory as `moe-rl train` leaves it: its config.yaml and metrics of two steps."""
    from moe_rl.config import to_yaml
    from moe_rl.orchestration.preflight import load_checked

    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(
        to_yaml(load_checked(REPO / TINY, [f"run.output_dir={folder.parent}", f"run.name={folder.name}"]))
    )
    (folder / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resuming_a_run_whose_checkpoints_are_a_link_loop_is_one_line_and_rewrites_nothing(tmp_path):
    """Taken for "no checkpoint yet", a resume retrained from step 0 and rewrote metrics.jsonl; now
    the resume stops with one line naming the folder, before Ray starts."""
    run = _a_run(tmp_path / "run")
    (run / "checkpoints").symlink_to("checkpoints")
    line = _cli_train(TINY, "--resume", str(run))
    assert f"E moe_rl.cli: {run / 'checkpoints'}: cannot be read (a symbolic link loop); " in line, line
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert "Started a local Ray instance" not in (run / "logs" / "train.log").read_text()


@pytest.mark.parametrize("state", ["link loop", "link to storage that is gone", "a file", "no permission"])
def test_a_checkpoints_folder_that_cannot_be_read_is_named_never_taken_for_none(tmp_path, monkeypatch, state):
    """What a resume and --force-new read (`newest_usable`, `claim`): an error naming the folder and
    why; --force-new deletes nothing. Root reads any folder whatever its mode, so "no permission"
    is the refusal of the read itself, as the kernel gives it to others."""
    from moe_rl.errors import EnvironmentFault

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    folder = run / "checkpoints"
    why = {"link loop": "a symbolic link loop", "a file": "not a folder", "no permission": "permission denied",
           "link to storage that is gone": f"a link to {tmp_path / 'scratch'}, which is not there"}[state]  # fmt: skip
    if state == "link loop":
        folder.symlink_to("checkpoints")
    elif state == "link to storage that is gone":
        folder.symlink_to(tmp_path / "scratch")
    elif state == "a file":
        folder.write_text("")
    else:
        _checkpoint(folder, 1)
        listdir = os.listdir

        def refused(path):
            if Path(path) == folder:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return listdir(path)

        monkeypatch.setattr(os, "listdir", refused)
    before = _files(run)
    for read in (rd.newest_usable, rd.sealed, lambda r: rd.claim(r, force_new=True)):
        with pytest.raises(EnvironmentFault) as err:
            read(run)
        assert str(err.value).startswith(f"{folder}: cannot be read ({why}); "), err.value
    assert _files(run) == before


@pytest.mark.parametrize("start", ["the run directory", "its checkpoint folder"])
def test_init_from_its_own_run_with_force_new_is_refused_before_anything_is_deleted(tmp_path, start):
    """`--init-from RUN --force-new` in RUN itself deleted the checkpoint it was to start from, then
    failed; now it is refused before any file goes."""
    run = _a_run(tmp_path / "sft")
    ckpt = _checkpoint(run / "checkpoints", 3)
    before = _files(run)
    init = run if start == "the run directory" else ckpt
    line = _cli_train(
        TINY, f"run.output_dir={tmp_path}", "run.name=sft", "--init-from", str(init), "--force-new"
    )
    assert (
        f"E moe_rl.cli: model.init_from={init} (--init-from) is in {run}, whose checkpoints --force-new "
        in line
    )
    assert _files(run) == {**before, rd.LOCK: b""}  # the lock taken, then released clean


def test_only_unsealed_checkpoints_resume_from_step_0_and_a_damaged_sealed_one_is_an_error(tmp_path, caplog):
    """A save cut short (a full disk, a stop) never was a checkpoint: with nothing older a resume
    starts from step 0, as the full-disk error promises; a sealed one that fails verification still
    stops it (from step 0 it would be overwritten)."""
    folder = tmp_path / "checkpoints"
    cut = _checkpoint(folder, 2)
    (cut / rd.MANIFEST).unlink()
    assert rd.unsealed(cut)
    with caplog.at_level(logging.WARNING):
        assert rd.newest_usable(tmp_path) is None
    assert (
        "checkpoint step_000002 is not usable (no manifest.json (the save did not finish)); no checkpoint"
        in caplog.text
    )
    damaged = _checkpoint(folder, 1)
    (damaged / "driver.json").write_text("{}")
    assert not rd.unsealed(damaged)
    with pytest.raises(
        ConfigError, match=r"no usable checkpoint \(step_000002: no manifest.json .*; step_000001: "
    ):
        rd.newest_usable(tmp_path)


# ----------------------------------------------------------------------------------- a full disk
def _on_a_full_device(path: Path) -> None:
    """The device under ``path``, a file this process holds open, is full from now on."""
    fds = Path("/proc/self/fd")
    (fd,) = [int(f.name) for f in fds.iterdir() if os.path.realpath(f) == str(path)]
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, fd)
    os.close(full)


def test_a_full_disk_under_metrics_or_tensorboard_is_one_line_naming_the_file(tmp_path, capfd):
    """Before any checkpoint: metrics.jsonl, then TensorBoard's event file, on a full device (writes
    fail with ENOSPC, as on a full disk). TensorBoard's writer thread printed a traceback of its
    own before; the writes are the driver's now."""
    from moe_rl.errors import EnvironmentFault

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    sink = MetricsSink(tmp_path, tensorboard=False)
    with pytest.raises(EnvironmentFault) as err:
        sink.log(0, {"reward/mean": 0.5})
    assert str(err.value).startswith(f"{tmp_path / 'metrics.jsonl'}: no space left on the device")
    assert str(err.value).endswith(f"while writing the metrics of step 0; {rd.AFTER_A_FULL_DISK}")
    (tmp_path / "metrics.jsonl").unlink()
    sink = MetricsSink(tmp_path)
    sink.log(0, {"reward/mean": 0.5})
    _on_a_full_device(sink.tb.path)
    with pytest.raises(EnvironmentFault) as err:
        sink.log(1, {"reward/mean": 0.6})
    assert str(err.value).startswith(f"{sink.tb.path}: no space left on the device"), err.value
    assert "while writing TensorBoard events; " in str(err.value)
    sink.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]  # metrics.jsonl has it
    assert "Traceback" not in capfd.readouterr().err


def test_a_log_file_on_a_full_disk_says_so_once_without_logging_errors(tmp_path, capsys):
    """logging printed "--- Logging error ---" and a traceback for every message it could not write."""
    from moe_rl.log import log_to_file, setup_logging

    root = logging.getLogger()
    state = (root.level, list(root.handlers), [list(h.filters) for h in root.handlers])
    path = tmp_path / "train.log"
    path.symlink_to("/dev/full")
    try:
        setup_logging("INFO", quiet=True)
        trace = log_to_file(path)
        for i in range(3):
            logging.getLogger("moe_rl.test").info("message %d", i)
        try:
            raise ValueError("bad input")
        except ValueError:
            trace.exception("the run stopped on bad input")
    finally:
        for handler in [h for h in root.handlers if h not in state[1]]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(state[0])
        for handler, filters in zip(state[1], state[2]):
            handler.filters = filters
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err, err
    said = [line for line in err.splitlines() if "no space left" in line]
    assert len(said) == 1 and said[0].endswith(
        f"W moe_rl.log: {path}: no space left on the device; the messages from here on miss from this file"
    ), err
    assert [line[-9:] for line in err.splitlines() if "moe_rl.test" in line] == [
        f"message {i}" for i in range(3)
    ]


def test_a_checkpoint_cut_by_a_full_disk_is_one_line_and_a_resume_skips_it(tmp_path, monkeypatch):
    """The real trainer's save on a full device (its first shard file on /dev/full; the device's
    free space as a full disk shows it): one line naming the checkpoint. The resume then does what
    the line promises: it skips the unsealed checkpoint (here from step 0, nothing older) and sets
    it aside, once the start is done."""
    import shutil

    from moe_rl.errors import EnvironmentFault
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked
    from tests.unit.trainer.trainer_testing import TINY_MODEL_OVERRIDES, TINY_RECIPE

    config = load_checked(
        TINY_RECIPE, [*TINY_MODEL_OVERRIDES, "rollout.batch_size=16", "rollout.group_size=4"]
    )
    local = LocalRun(config, run_dir=tmp_path)
    sink = MetricsSink(tmp_path, tensorboard=False)
    record = local.step(0)
    sink.log(record.pop("step"), record)
    shard = tmp_path / "checkpoints" / "step_000000" / "trainer" / "__0_0.distcp"
    shard.parent.mkdir(parents=True)
    shard.symlink_to("/dev/full")
    usage = shutil.disk_usage(tmp_path)
    with monkeypatch.context() as full:
        full.setattr(shutil, "disk_usage", lambda path: usage._replace(free=3 << 20))
        with pytest.raises(EnvironmentFault) as err:
            local.job.checkpoint()
    ckpt = tmp_path / "checkpoints" / "step_000000"
    assert str(err.value) == (
        f"{ckpt}: no space left on the device (3 MiB free) while writing checkpoint step_000000; "
        f"{rd.AFTER_A_FULL_DISK}"
    )
    assert rd.unsealed(ckpt) and rd.newest_usable(tmp_path) is None
    assert local.job.restore(sink, None) == 0
    (aside,) = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert aside.startswith("step_000000.unusable-")
    assert read_metrics(tmp_path) == []


@pytest.mark.parametrize("entry", ["a file", "a link to nothing", "a link loop"])
def test_a_step_entry_that_is_not_a_readable_folder_is_never_taken_for_a_save_cut_short(tmp_path, entry):
    """A ``step_N`` that is a file or a dead link was never a save that stopped half way (those are
    readable folders without a manifest): a resume with nothing older stops, naming it, rather than
    starting from step 0 over it; beside an older good checkpoint it is skipped with its reason."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    odd = folder / "step_000005"
    if entry == "a file":
        odd.write_text("")
    elif entry == "a link to nothing":
        odd.symlink_to(tmp_path / "gone")
    else:
        odd.symlink_to("step_000005")
    assert not rd.unsealed(odd)
    with pytest.raises(ConfigError, match=r"no usable checkpoint \(step_000005: no manifest.json "):
        rd.newest_usable(tmp_path)
    good = _checkpoint(folder, 3)
    assert rd.newest_usable(tmp_path) == rd.Usable(good, 3)


@pytest.mark.parametrize("link", ["to nothing", "a loop"])
def test_init_from_a_run_whose_checkpoints_is_a_broken_link_names_the_link(tmp_path, link):
    """`model.init_from=RUN` whose ``checkpoints/`` is a link that leads nowhere: the error names
    the link and why, not "neither a run directory nor a checkpoint folder"."""
    from moe_rl.errors import EnvironmentFault

    run = tmp_path / "sft"
    run.mkdir()
    if link == "to nothing":
        (run / "checkpoints").symlink_to(tmp_path / "scratch")
        why = f"a link to {tmp_path / 'scratch'}, which is not there"
    else:
        (run / "checkpoints").symlink_to("checkpoints")
        why = "a symbolic link loop"
    with pytest.raises(EnvironmentFault) as err:
        rd.init_checkpoint(run)
    assert str(err.value).startswith(f"{run / 'checkpoints'}: cannot be read ({why}); ")
    with pytest.raises(UserError, match=r"model.init_from=.*: neither a run directory with checkpoints/"):
        rd.init_checkpoint(tmp_path / "empty")


def test_init_from_a_checkpoint_or_a_run_takes_its_trainer_state_and_refuses_what_cannot_be_used(tmp_path):
    run = tmp_path / "run"
    ckpt = _checkpoint(run / "checkpoints", 4)
    newer = _checkpoint(run / "checkpoints", 6)
    assert rd.init_checkpoint(ckpt) == ckpt / "trainer"
    assert rd.init_checkpoint(run) == newer / "trainer"
    (newer / "driver.json").write_text("{}")  # damaged: the run's newest usable is the older one
    assert rd.init_checkpoint(run) == ckpt / "trainer"
    with pytest.raises(UserError, match=r"^critic.init_from=X: the checkpoint is not usable: driver.json "):
        rd.init_checkpoint(newer, "critic.init_from=X")
    (ckpt / "driver.json").write_text("{}")
    with pytest.raises(UserError, match=rf"^model.init_from={run}: no usable checkpoint \(step_000006: "):
        rd.init_checkpoint(run)  # the resume's wording (--resume RUN) left out
    empty = tmp_path / "empty_run"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match=r"^model.init_from=.*: the run has no checkpoint yet$"):
        rd.init_checkpoint(empty)


# ----------------------------------------------------------------- edges (mutation survivors)
def test_the_lock_makes_a_run_directory_whose_parents_are_not_there_yet(tmp_path):
    run = tmp_path / "runs" / "team" / "first"
    with rd.RunLock(run) as lock:
        assert run.is_dir() and lock.owner in (run / rd.LOCK).read_text()
    with pytest.raises(rd.RunDirLost):  # a lock taken, then its directory gone
        lock = rd.RunLock(tmp_path / "gone")
        lock.acquire()
        try:
            (tmp_path / "gone").rename(tmp_path / "elsewhere")
            lock.check()
        finally:
            lock.release()


def test_the_full_disk_bound_holds_at_64_mib_free_and_not_one_byte_under(tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    for free, full in ((64 << 20, False), ((64 << 20) - 1, True)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage._replace(free=free))
        assert (rd.disk_full(tmp_path, "x") is not None) == full, free
    # said by the operating system: full whatever the free space shows
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 40))
    assert rd.disk_full(tmp_path, "x", said=True) is not None


def test_the_free_space_is_read_on_the_nearest_folder_that_exists(tmp_path, monkeypatch):
    import shutil

    asked = []
    real = shutil.disk_usage

    def usage(path):
        asked.append(Path(path))
        return real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    assert rd.disk_full(tmp_path / "not" / "yet" / "there.bin", "x") is None
    assert asked == [tmp_path]
    assert rd._nearest_existing(Path("/")) == Path("/")  # the root ends the walk


def test_an_os_refusal_without_a_file_name_names_the_path_written(tmp_path, monkeypatch):
    import shutil

    from moe_rl.errors import EnvironmentFault

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 40))
    unnamed = pytest.raises(EnvironmentFault, match=rf"^{tmp_path}/m\.bin: .* while writing the metrics")
    with unnamed, rd.writing(tmp_path / "m.bin", "the metrics"):
        raise OSError(errno.EROFS, "Read-only file system")  # a write to an open file: no name
    with (
        pytest.raises(EnvironmentFault, match=r"^/data/other: "),
        rd.writing(tmp_path / "m.bin", "the metrics"),
    ):
        raise OSError(errno.EROFS, "Read-only file system", "/data/other")


def test_a_stopped_start_removes_what_it_made_and_only_that(tmp_path):
    made = tmp_path / "made"
    (made / "logs").mkdir(parents=True)
    (made / "config.yaml").write_text("x: 1\n")
    assert rd.unclaim(made, made=True) == f"removed the run directory {made}"
    assert not made.exists()
    theirs = tmp_path / "theirs"
    (theirs / "logs").mkdir(parents=True)
    (theirs / "config.yaml").write_text("x: 1\n")
    assert rd.unclaim(theirs, made=False) == f"nothing of the run is left in {theirs}"
    assert sorted(p.name for p in theirs.iterdir()) == ["logs"]
    assert rd.unclaim(theirs, made=False) == f"nothing of the run is left in {theirs}"  # no config.yaml: fine
    ran = tmp_path / "ran"
    ran.mkdir()
    (ran / "metrics.jsonl").write_text('{"step": 0}\n')
    (ran / "config.yaml").write_text("x: 1\n")
    assert rd.unclaim(ran, made=True) == f"{ran} holds what the run wrote"
    assert sorted(p.name for p in ran.iterdir()) == ["config.yaml", "metrics.jsonl"]


def test_a_folder_that_cannot_be_listed_for_a_reason_without_a_name_says_the_system_s_words(
    tmp_path, monkeypatch
):
    from moe_rl.errors import EnvironmentFault

    def listdir(folder):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "listdir", listdir)
    with pytest.raises(EnvironmentFault, match=r"cannot be read \(input/output error\)"):
        rd._names(tmp_path)


def test_the_manifest_holds_zlib_s_crc32_of_each_file_so_older_manifests_verify(tmp_path):
    import zlib

    ckpt = tmp_path / "step_000001"
    (ckpt / "trainer").mkdir(parents=True)
    data = os.urandom(3 << 20)
    (ckpt / "trainer" / "a.bin").write_bytes(data)
    rd.write_manifest(ckpt)
    files = json.loads((ckpt / rd.MANIFEST).read_text())["files"]
    assert files == {"trainer/a.bin": {"bytes": len(data), "crc32": zlib.crc32(data)}}
    assert rd.verify(ckpt) is None


@pytest.mark.parametrize(
    "manifest",
    ["{not json", '{"no_files": 1}', '["a list"]', b"\xff\xfe not utf-8"],
    ids=["not-json", "no-files-key", "not-a-mapping", "not-utf8"],
)
def test_a_manifest_that_cannot_be_read_is_a_reason_not_a_crash(tmp_path, manifest):
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    path = ckpt / rd.MANIFEST
    path.write_bytes(manifest if isinstance(manifest, bytes) else manifest.encode())
    assert rd.verify(ckpt).startswith("manifest.json is unreadable (")


def test_a_run_s_records_must_be_mappings_with_an_integer_step(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    for bad in ("[1, 2]", '{"step": "3"}', '{"no_step": 1}', '{"step": 1.5}'):
        path.write_text(f'{{"step": 0}}\n{bad}\n{{"step": 2}}\n')
        with pytest.raises(ValueError, match=r"line 2 is not a metrics record \(not a step record\)"):
            rd.read_records(path)
    # a bad line followed only by blank lines is the torn last one; blank lines between are skipped
    path.write_text('{"step": 0}\n\n{"step": 1}\n{"ste\n\n\n')
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in rd.read_records(path)] == [0, 1]
    assert "line 4 is incomplete" in caplog.text
    long = '{"step": "' + "x" * 200 + '"}'
    path.write_text(f'{long}\n{{"step": 1}}\n')
    with pytest.raises(ValueError) as err:
        rd.read_records(path)
    assert str(err.value).endswith(repr(long.encode()[:80]))


def test_where_a_resume_continues_is_decided_once_and_cannot_be_changed(tmp_path):
    import dataclasses

    _checkpoint(tmp_path / "checkpoints", 3)
    usable = rd.newest_usable(tmp_path)
    assert usable.step == 3
    point = rd.Resume(usable)
    for value, field in ((usable, "step"), (point, "checkpoint")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)


def test_a_device_whose_free_space_cannot_be_read_is_full_only_when_the_system_said_so(tmp_path, monkeypatch):
    import shutil

    def unreadable(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(shutil, "disk_usage", unreadable)
    assert rd.disk_full(tmp_path, "x") is None
    said = rd.disk_full(tmp_path, "x", said=True)
    assert str(said).startswith(f"{tmp_path}: no space left on the device while writing x;")  # no MiB free
