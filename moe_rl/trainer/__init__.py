"""The training side of an RL step, on the Megatron layer of `moe_rl.megatron`: the log-prob
passes (`logprobs`), the pipelined schedule (`pipeline`), micro-batches (`batch`), optimizer and
schedule (`optim`), the trainer's rules on a recipe (`rules`) and `worker.TrainerWorker`, which
runs the RL passes and checkpoints.

Submodules are imported explicitly (``from moe_rl.trainer.worker import TrainerWorker``); this
package imports nothing eagerly, so importing it does not load Megatron.
"""

__all__ = ["batch", "logprobs", "optim", "pipeline", "rules", "worker"]
