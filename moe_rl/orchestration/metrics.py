"""Per-step metrics of a run: `metrics.jsonl` (one JSON object per step), TensorBoard events,
optional W&B, a one-line step summary in the log, and a summary of the whole run at its end."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_rl.run_dir import METRICS, ensure_owned, read_records, writing

log = logging.getLogger("moe_rl.metrics")

MEASURED_PREFIXES = ("time/", "perf/")
"""Metrics that measure how long work took (and the rates made from it): they differ between two
runs that compute the same thing, while every other metric of a deterministic run repeats."""


def measured(key: str) -> bool:
    """Whether metric ``key`` measures time (`MEASURED_PREFIXES`, or a ``*seconds`` one such as
    ``sync/seconds``) or a rate made from it."""
    return key.startswith(MEASURED_PREFIXES) or key.endswith("seconds")


def repeatable(record: dict, apart: tuple[str, ...] = ()) -> dict:
    """The metrics of a step record that a run computing the same thing repeats: not the `measured`
    ones, nor those whose name starts with one of ``apart`` (what the two runs differ in on
    purpose, e.g. ``memory/`` between a run that gives memory back and one that keeps it)."""
    return {k: v for k, v in record.items() if not measured(k) and not k.startswith(apart)}


SUMMARY_KEYS = (
    ("reward/mean", "reward {:.3f}"),
    ("response/length_mean", "len {:.1f}"),
    ("env/turns_per_trajectory", "turns {:.2f}"),  # multi-turn runs only
    ("env/tool_calls_per_trajectory", "calls {:.2f}"),
    ("old/kl_k3", "kl {:.2e}"),
    ("train/icepop_masked_frac", "icepop {:.2%}"),
    ("old/routing_agreement", "route {:.3f}"),
    ("train/grad_norm", "gnorm {:.3f}"),
    ("critic/loss", "vloss {:.3f}"),  # with a critic
    ("distill/reverse_kl", "rkl {:.3f}"),  # with a distillation teacher
    ("perf/mfu", "mfu {:.1%}"),
    ("time/reward_s", "scoring {:.1f}s"),  # when it is the step's longest stage
    ("time/step_s", "{:.1f}s"),
)
STEP_TIME = "time/step_s"
"""The whole step's time; every other ``time/*_s`` is one stage's, shown on the step line (when it is
one of `SUMMARY_KEYS`) only when it is the longest of the step's stages."""


def _scalar(value: Any) -> float | int | str | None:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return None


class TensorBoardEvents:
    """TensorBoard scalars, written in the driver's own thread and flushed at each step into an event
    file made at the first one. (TensorBoard's `SummaryWriter` writes from a thread of its own: a
    write it fails, on a full disk, printed that thread's traceback and surfaced at a later call.)
    A write the machine refuses is one line naming the file (`moe_rl.run_dir.writing`)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path: Path | None = None
        self._records = None
        """A `tensorboard.summary.writer.record_writer.RecordWriter` over the open event file."""

    def write(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        with writing(self.path or self.folder, "TensorBoard events"):
            if self._records is None:
                self._open()
            for key, value in values.items():
                summary = Summary(value=[Summary.Value(tag=key, simple_value=float(value))])
                self._records.write(
                    Event(wall_time=time.time(), step=step, summary=summary).SerializeToString()
                )
            self._records.flush()

    def _open(self) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = self.folder / name
        self._records = RecordWriter(open(self.path, "wb"))  # noqa: SIM115 (open until `close`)
        self._records.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())

    def close(self) -> None:
        if self._records is not None:
            with contextlib.suppress(OSError):  # a write that failed has said so already
                self._records.close()


class MetricsSink:
    """Writes one record per step; `resume_from(step)` drops records after a checkpoint."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        run_name: str = "",
        config: Mapping[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS
        self.tb = TensorBoardEvents(self.run_dir / "tensorboard") if tensorboard else None
        self.wandb = None
        if wandb_project:
            import wandb  # the key comes from WANDB_API_KEY in the environment, never from files

            if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
                raise ValueError("logging.wandb_project is set but WANDB_API_KEY is not in the environment")
            self.wandb = wandb.init(project=wandb_project, name=run_name, config=dict(config or {}))

    def resume_from(self, step: int) -> None:
        """Keep only the records of steps < `step` (a resumed run rewrites the rest); written to a
        temporary file and renamed, so an interruption leaves the old file whole."""
        if not self.path.exists():
            return
        ensure_owned(self.run_dir)
        kept = [json.dumps(record) for record in read_records(self.path) if record["step"] < step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        with writing(tmp, "the metrics kept"):
            tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        record: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            scalar = _scalar(value)
            if scalar is None:
                raise ValueError(f"metric {key!r} is not a scalar: {type(value).__name__}")
            record[key] = scalar
        ensure_owned(self.run_dir)  # this run still holds its directory
        with writing(self.path, f"the metrics of step {step}"), self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            self.tb.write(step, numeric)
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)
        log.info("step %d | %s", step, summary_line(record))
        return record

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def summary_line(record: Mapping[str, Any]) -> str:
    """The step line: the `SUMMARY_KEYS` a record has; a stage's time only when it is the longest."""
    return " | ".join(fmt.format(record[key]) for key, fmt in SUMMARY_KEYS if _shown(record, key))


def _shown(record: Mapping[str, Any], key: str) -> bool:
    value = record.get(key)
    if not isinstance(value, (int, float)):
        return False
    if key.startswith("time/") and key != STEP_TIME:  # a stage's time: the longest stage only
        stages = [v for k, v in record.items() if k.startswith("time/") and k != STEP_TIME]
        return value >= max(v for v in stages if isinstance(v, (int, float)))
    return True


def run_summary(
    records: Sequence[Mapping[str, Any]], steps: int, wall_s: float, run_dir: Path, checkpoints: Sequence[Path]
) -> str:  # fmt: skip
    """The end of a run in a few lines: steps done of ``steps`` and the wall time; the mean reward
    of the first and of the last few steps (a fifth of them, 1 to 5) and the best step; the mean
    engine–trainer mismatch `old/kl_k3`; the sealed checkpoints; the commands to run next."""
    done = len(records)
    lines = [f"{'done' if done >= steps else 'stopped'}: {done}/{steps} steps in {_duration(wall_s)}"]
    rewards = _series(records, "reward/mean")
    if rewards:
        k = max(1, min(5, len(rewards) // 5))
        best_step, best = max(rewards, key=lambda item: item[1])
        lines.append(
            f"  reward       {_mean(rewards[:k]):.3f} → {_mean(rewards[-k:]):.3f} (mean of the first / last "
            f"{k} step{'s' * (k > 1)}), best {best:.3f} at step {best_step}"
        )
    kl = _series(records, "old/kl_k3")
    if kl:
        lines.append(f"  mismatch     old/kl_k3 {_mean(kl):.2e} (mean over the steps)")
    latest = f", latest {checkpoints[-1]}" if checkpoints else ""
    lines.append(f"  checkpoints  {len(checkpoints)}{latest}")
    run = shlex.quote(str(run_dir))
    resume = f"moe-rl train {shlex.quote(str(Path(run_dir) / 'config.yaml'))} --resume {run}"
    lines += [
        f"  next         moe-rl report {run}    (plots and a markdown summary)",
        f"               moe-rl export {run} OUT    (a Hugging Face folder of the weights)",
        f"               {resume} run.steps={2 * steps}    (more steps)"
        if done >= steps
        else f"               {resume}    (the remaining steps)",
    ]
    return "\n".join(lines)


def _series(records: Sequence[Mapping[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]


def _mean(series: Sequence[tuple[int, float]]) -> float:
    return sum(value for _, value in series) / len(series)


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours} h {m:02d} min" if hours else f"{m} min {s:02d} s" if m else f"{s} s"
