"""The data of offline training (DGO, SFT): stored trajectories read, validated against the model and
joined (`read_offline`), or generated once by the starting policy into the run directory
(`OfflineData`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe_rl.config.schema import RecipeConfig
from moe_rl.data.shards import read_trajectories
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.errors import ConfigError


def read_offline(config: RecipeConfig, folder: Path) -> TrajectoryBatch:
    """Stored trajectories for offline training, validated like live data against the model
    (token ids, expert ids, kept sets, log-probs): nothing trains on data that fails `validate`."""
    m = config.model
    stored = read_trajectories(
        folder, include_old_logp=False, vocab_size=m.vocab_size, num_experts=m.num_experts or None,
        topk=m.moe_router_topk if m.num_experts else None,
    )  # fmt: skip
    data = TrajectoryBatch.concat(list(stored))
    size = config.rollout.batch_size
    if data.num_samples < size:
        raise ConfigError(
            f"data.trajectories={folder}: {data.num_samples} samples < rollout.batch_size={size}"
        )
    return data


class OfflineData:
    """What an offline run trains on: the stored trajectories of `data.trajectories` (or `moe-rl
    sft`'s demonstrations), read and validated by the preflight, or the `data.offline_batches`
    batches the starting policy generates once into ``<run_dir>/offline_data`` (`store`), which a
    resumed run reads back."""

    def __init__(
        self, config: RecipeConfig, run_dir: Path | None, stored: TrajectoryBatch | None, rewarder: Any
    ):  # fmt: skip
        """``rewarder``: the reward worker, which holds a generated batch and writes it (`store`)."""
        self.config, self.run_dir, self.stored, self.rewarder = config, run_dir, stored, rewarder

    @property
    def folder(self) -> Path:
        if self.run_dir is None:
            raise ValueError(
                "an offline run without data.trajectories keeps the data it generates in its run "
                "directory, and this run has none"
            )
        return self.run_dir / "offline_data"

    def dataset(self) -> list[TrajectoryBatch] | None:
        """The data in `rollout.batch_size` slices; None while it is not generated."""
        data = self.stored
        if data is None:
            if not (self.folder / "complete").exists():
                return None
            data = read_offline(self.config, self.folder)
        size = self.config.rollout.batch_size
        return [data.slice(i, i + size) for i in range(0, data.num_samples - size + 1, size)]

    def store(self, i: int, scored: int) -> None:
        """The reward worker's batch `ScoredSummary.scored` ``scored`` as generated batch ``i``
        (the data is complete after the last of `data.offline_batches`)."""
        self.rewarder.dump(str(self.folder / f"batch_{i:04d}"), i, scored)
        if i + 1 == self.config.data.offline_batches:
            (self.folder / "complete").write_text("")
