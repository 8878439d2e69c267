"""The quantization recipes' rules on a machine, without torch: what needs a CUDA GPU."""

from __future__ import annotations

from moe_rl.config.derived import quant_needs_cuda
from moe_rl.config.schema import QuantConfig
from moe_rl.rules import Rule

CPU_RECIPES = "fp8_block128, fp8_tensor, int8 or int4_awq"
"""The quantization recipes that run on a CPU (ModelOpt fake quantization in the Megatron engine)."""


def cuda_rule(quant: QuantConfig, cuda: bool, where: str = "this machine") -> Rule:
    """A recipe that needs a CUDA GPU (`quant_needs_cuda`: NVFP4, or ``quant.requires_cuda``) runs
    only where there is one; ``where`` names the engine and device in the detail."""
    return Rule(
        "quantization recipe needs CUDA",
        cuda or not quant_needs_cuda(quant),
        f"{where} cannot run rollout.quant={quant.name} ({quant.method}): it needs a CUDA GPU; alternatives on "
        f"CPU: rollout.engine=megatron with {CPU_RECIPES}",
    )
