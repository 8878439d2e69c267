"""Rollout weight quantization: the recipes (ModelOpt quantizers, AWQ, the sync's error report,
vLLM's block-FP8 layout: `recipes`), the block-FP8 kernel (`fp8_block`: Triton on CUDA, ModelOpt
elsewhere), fused CPU kernels for the FP8 wire (`fused`) and the recipes' rules on a machine
(`rules`, torch-free). Below both `moe_rl.rollout` (engines quantize what they receive) and
`moe_rl.weight_sync` (senders quantize what they send). Submodules are imported explicitly; this
package imports nothing eagerly.
"""

__all__ = ["fp8_block", "fused", "recipes", "rules"]
