"""The Megatron-core layer that the trainer and the Megatron rollout engine share.

Model build from recipes and HF configs (`model`), HF <-> Megatron weights (`hf_weights`), the
compatibility shims for a missing transformer-engine or CUDA (`compat`), the packed attention of
the local spec (`attention`), torch.distributed and parallel state (`parallel`), routing replay
(`replay`), the forward of a packed micro-batch (`forward`), step-by-step decoding with a KV cache
through Megatron-core's static inference context (`decoding`) and the layout rules (`rules`).
`moe_rl.trainer` (the RL passes, optimizer, checkpoints) and `moe_rl.rollout` (the Megatron
engine) both import from here; neither reaches into the other.

Submodules are imported explicitly; this package imports nothing eagerly.
"""

__all__ = ["attention", "compat", "decoding", "forward", "hf_weights", "model", "parallel", "replay", "rules"]
