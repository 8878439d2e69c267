"""The training side of an RL step, on the Megatron layer of `moe_rl.megatron`: what a rank
trains on (`batch`: `TrainerBatch`, micro-batches, `PreparedBatch`), the passes over
micro-batches at any pipeline size (`passes`, with Megatron's 1F1B schedule in `pipeline`),
single-micro-batch log-prob helpers (`logprobs`), the recipe's loss resolved once (`loss`), the
optimizer step and its reductions (`update`), optimizer and schedule (`optim`), checkpoints
(`checkpoint`), the reference policy (`reference`), the trainer's rules on a recipe (`rules`) and
`worker.TrainerWorker`, which composes them.

Submodules are imported explicitly (``from moe_rl.trainer.worker import TrainerWorker``); this
package imports nothing eagerly, so importing it does not load Megatron.
"""

__all__ = [
    "batch",
    "checkpoint",
    "logprobs",
    "loss",
    "optim",
    "passes",
    "pipeline",
    "reference",
    "rules",
    "update",
    "worker",
]
