"""Rollout engines: the protocol (``engine``), capability checks before launch (``capabilities``),
the Megatron engine (``megatron_engine``) and its sampler (``sampler``), the vLLM engine
(``vllm_engine``, imports vLLM) and its worker extension (``vllm_worker``), and a tiny Hugging Face
checkpoint and tokenizer made locally (``tiny_hf``, ``tiny_tokenizer``: `moe-rl make-model`, the
tests and benches). Quantization recipes live in `moe_rl.quant`.

Importing this package is light: vLLM is imported only with ``moe_rl.rollout.vllm_engine``.
"""

from moe_rl.rollout.capabilities import Machine, check_recipe, engine_capabilities
from moe_rl.rollout.engine import EngineCapabilities, RolloutEngine, SamplingSpec

__all__ = [
    "EngineCapabilities",
    "Machine",
    "RolloutEngine",
    "SamplingSpec",
    "check_recipe",
    "engine_capabilities",
]
