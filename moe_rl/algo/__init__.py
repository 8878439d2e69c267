"""Pure RL math on tensors: log-probs (incl. keep-sampling-mask), advantages, objectives,
corrections, KL estimators, aggregation and mismatch diagnostics.

No config objects, no ``torch.distributed``, no ``.item()``. Submodules are imported
explicitly (``from moe_rl.algo import objectives``); this package imports nothing eagerly so
that ``moe_rl.algo.registry`` (the recipe-name tables) stays importable without torch.
"""

__all__ = [
    "advantages",
    "aggregate",
    "corrections",
    "diagnostics",
    "kl",
    "logprobs",
    "objectives",
    "registry",
]
