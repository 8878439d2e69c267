"""The Megatron-core training side: model build from recipes and HF configs (`model`), HF <->
Megatron weights (`hf_weights`), the Megatron compatibility shims (`megatron_compat`), the packed
attention of the local spec (`attention`), torch.distributed and
Megatron parallel state (`parallel`), the routing replay adapter (`replay`), the log-prob passes
(`logprobs`), optimizer and schedule (`optim`), and `worker.TrainerWorker`, which runs the RL
passes and checkpoints.

Submodules are imported explicitly (``from moe_rl.trainer.worker import TrainerWorker``); this
package imports nothing eagerly, so importing it does not load Megatron.
"""

__all__ = [
    "attention",
    "batch",
    "hf_weights",
    "logprobs",
    "megatron_compat",
    "model",
    "optim",
    "parallel",
    "replay",
    "worker",
]
