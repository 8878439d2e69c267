"""Rollout engines: the protocol (``engine``), capability checks before launch (``capabilities``),
the vLLM engine (``vllm_engine``, imports vLLM) and its worker extension (``vllm_worker``), the
Megatron engine's sampler (``sampler``), quantization recipes (``quant``) and a tiny Hugging Face
checkpoint maker for tests (``tiny_hf``).

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
