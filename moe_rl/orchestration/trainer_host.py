"""One trainer rank's process, wherever it runs: a rank of the Ray trainer group
(`moe_rl.orchestration.actors.TrainerRank`) or the one-process loop's trainer
(`moe_rl.orchestration.local.LocalTrainer`). Both wrap it thinly: they fetch what the rank needs
(its shard, its receivers) their own way and hand it over. Imports no Ray."""

from __future__ import annotations

from typing import Any

from moe_rl.config.schema import RecipeConfig
from moe_rl.config.sync_plan import SyncPlan
from moe_rl.weight_sync.protocol import SyncTarget
from moe_rl.weight_sync.report import SyncReport


class TrainerHost:
    """A trainer rank: its `moe_rl.trainer.worker.TrainerWorker`, its side of every weight sync (a
    `moe_rl.weight_sync.sender.RankSender` that follows the run's sync plan, handed down by the
    process that started the run) and the batch its π_old pass prepared, until `train` takes it."""

    def __init__(self, config: RecipeConfig, sync: SyncPlan, host: str | None = None):
        """``host``: the address receivers on other nodes reach this rank at (None: this machine's
        name resolved). The rank's torch.distributed world is joined already, where it has one."""
        from moe_rl.trainer.worker import TrainerWorker
        from moe_rl.weight_sync.sender import RankSender

        self.config = config
        self.worker = TrainerWorker(config)
        self.rank = self.worker.info.rank
        """This rank in the trainer's torch.distributed world (0 in one process)."""
        c = config
        self.sender = RankSender(
            self.worker.model, c.quant, c.model.num_layers, sync, self.rank, host=host,
            vllm_workers=c.rollout.tensor_parallel_size, lora=c.lora,
        )  # fmt: skip
        self._prepared: dict[int, Any] = {}
        """handle -> the batch its π_old pass prepared (`old_logp` / `train`)."""

    @property
    def model(self):
        return self.worker.model

    def old_logp(self, shard: Any, part: Any, handle: int) -> dict[str, float]:
        """The π_old pass on this rank's ``shard`` of a step's batch with the rest of its
        `moe_rl.orchestration.rank_parts.RankPart` ``part`` (advantages, share, zero-variance signs);
        the prepared batch is kept under ``handle`` until `train` takes it (a new step's batch
        replaces one never trained on). The pass's metrics."""
        from moe_rl.trainer.batch import TrainerBatch

        prepared = self.worker.old_logp(
            TrainerBatch.of_share(shard, part.advantages, part.share, part.zvp_signs)
        )
        self._prepared = {handle: prepared}
        return prepared.metrics

    def train(self, handle: int) -> dict[str, float]:
        """One optimizer step per mini-batch of the batch prepared under ``handle``."""
        prepared = self._prepared.pop(handle, None)
        if prepared is None:
            raise RuntimeError(f"trainer rank {self.rank}: no batch prepared under handle {handle}")
        return self.worker.train(prepared)

    def send(
        self, receivers: dict[int, Any], target: SyncTarget, timeout_s: float, whole: bool
    ) -> SyncReport:
        """This rank's part of a sync to ``target`` of ``receivers`` (`moe_rl.weight_sync.transport.
        Receiver` s by engine index; ``whole`` False: only what trains); parameters released for a
        generation come back for it."""
        with self.worker.weights_resident():
            reference = SyncTarget(target) == SyncTarget.REFERENCE
            return self.sender.send(receivers, reference, timeout_s, whole)

    def release_memory(self, params: bool) -> dict[str, float]:
        """What generation does not need out of device memory (colocated): the sync's device buffers
        (the engines mapped them only for the sync), the optimizer state and gradients (and the
        parameters, with ``params``)."""
        self.sender.release()
        return self.worker.release_memory(params)

    def restore_memory(self) -> dict[str, float]:
        return self.worker.restore_memory()

    def save_hf(self, directory: str) -> str:
        """The weights as a Hugging Face folder (collective: every rank writes the tensors it sends,
        `moe_rl.weight_sync.outgoing.sends`)."""
        from moe_rl.megatron.hf_weights import save_hf_checkpoint
        from moe_rl.megatron.model import model_config_to_hf_config
        from moe_rl.weight_sync.outgoing import sends

        save_hf_checkpoint(
            self.worker.model, directory, model_config_to_hf_config(self.config.model), select=sends
        )
        return directory

    def save_checkpoint(self, directory: str) -> str:
        return str(self.worker.save_checkpoint(directory))

    def load_checkpoint(self, directory: str) -> int:
        return self.worker.load_checkpoint(directory)

    def close(self) -> None:
        """Remove this rank's shared weight-sync slots and arena file (before the process ends)."""
        self.sender.close()
