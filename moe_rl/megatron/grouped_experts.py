"""All local experts of a MoE layer in two grouped matrix products, without transformer-engine.

Megatron-core builds ``SequentialMLP`` when transformer-engine is absent: one module call, two
small GEMMs and an activation per expert, 64 or more per layer and pass, which leaves a GPU
launch-bound. `GroupedExperts` is that module with another forward. Its parameters are
``SequentialMLP``'s, unchanged (``local_experts.{i}.linear_fc1.weight``, ``[2F, H]``, gate rows
then up rows; ``local_experts.{i}.linear_fc2.weight``, ``[H, F]``), so checkpoints, the Hugging
Face names, weight sync and routing replay see the same model, and a checkpoint moves between
``trainer.expert_gemm=torch`` and ``sequential`` as it is.

The forward stacks the expert weights (``[E, 2F, H]`` and ``[E, H, F]``; the copy is small next to
the products and its backward hands each expert its own gradient) and multiplies the tokens,
already sorted by expert, with ``torch._grouped_mm`` where it runs: CUDA, bf16 or fp32 alignment,
compute capability 9.0 or newer. Elsewhere (the CPU, older GPUs) it runs the same products one
expert after another with plain matrix products: the exact fallback. What it cannot do as
``SequentialMLP`` does (expert biases, FP8/FP4 training, probabilities applied on the input,
activations other than SwiGLU, clamped GLU, expert linears that were converted or hooked, as
ModelOpt's quantization does) it hands to ``SequentialMLP.forward``.

LoRA: expert linears with adapters (`moe_rl.megatron.lora`) add each expert's ``s·B·A·x`` in both
paths, as two more grouped products of the stacked adapter factors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from moe_rl.megatron.lora import has_adapter

ALIGN_BYTES = 16
"""`torch._grouped_mm` needs every row stride to be a multiple of 16 bytes."""


def grouped_mm_runs(device: torch.device, dtype: torch.dtype, *widths: int) -> bool:
    """Whether `torch._grouped_mm` runs these products: CUDA with compute capability 9.0 or newer,
    bf16, and every width a whole number of 16-byte rows."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    size = torch.empty((), dtype=dtype).element_size()
    return all(width * size % ALIGN_BYTES == 0 for width in widths)


class GroupedExperts(SequentialMLP):
    """``SequentialMLP``'s parameters, its experts' products grouped (see the module docstring)."""

    kernel: str | None = None
    """The products of the last forward: ``grouped_mm`` or ``loop`` (None before the first, or
    when ``SequentialMLP.forward`` ran it)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        super().__init__(num_local_experts, config, submodules, pg_collection)
        self._linear_types = (submodules.linear_fc1, submodules.linear_fc2)

    def _plain_linears(self) -> bool:
        """Every expert's linear layers are the ones the layer spec built, untouched: a layer that
        was converted (ModelOpt's quantized linears swap its class) or is hooked computes more than
        its weight's product, which only its own forward does."""
        fc1_type, fc2_type = self._linear_types
        for expert in self.local_experts:
            for linear, kind in ((expert.linear_fc1, fc1_type), (expert.linear_fc2, fc2_type)):
                if type(linear) is not kind or linear._forward_hooks or linear._forward_pre_hooks:
                    return False
        return True

    def _grouped_forward_applies(self) -> bool:
        c = self.config
        return self._plain_linears() and (
            c.gated_linear_unit
            and c.activation_func is F.silu
            and not c.add_bias_linear
            and not (c.fp8 or c.fp4)
            and not c.moe_apply_probs_on_input
            and not c.use_te_activation_func
            and getattr(c, "activation_func_clamp_value", None) is None
            and getattr(c, "glu_linear_offset", 0.0) == 0.0
        )

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ):
        """The experts' outputs for tokens sorted by expert (``tokens_per_expert`` of each), each
        scaled by its routing probability, as ``SequentialMLP.forward`` returns them."""
        if not self._grouped_forward_applies():
            self.kernel = None
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        hidden, probs = permuted_local_hidden_states, permuted_probs
        experts = list(self.local_experts)
        ffn = experts[0].linear_fc1.weight.shape[0]
        ranks = [experts[0].linear_fc1.lora_a.shape[0]] if has_adapter(experts[0].linear_fc1) else []
        if grouped_mm_runs(hidden.device, hidden.dtype, hidden.shape[-1], ffn, ffn // 2, *ranks):
            self.kernel = "grouped_mm"
            return self._grouped(hidden, tokens_per_expert, probs, experts), None
        self.kernel = "loop"
        return self._loop(hidden, tokens_per_expert, probs, experts), None

    @staticmethod
    def _glu(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(x, 2, dim=-1)
        out = F.silu(gate) * up
        return (out * probs.unsqueeze(-1)).to(out.dtype)

    def _grouped(self, hidden, tokens_per_expert, probs, experts) -> torch.Tensor:
        counts = tokens_per_expert.to(device=hidden.device, dtype=torch.int32)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        inner = _grouped_product([e.linear_fc1 for e in experts], hidden, offsets)  # [T, 2F]
        return _grouped_product([e.linear_fc2 for e in experts], self._glu(inner, probs), offsets)

    def _loop(self, hidden, tokens_per_expert, probs, experts) -> torch.Tensor:
        counts = tokens_per_expert.tolist()
        outputs = [
            _product(e.linear_fc2, self._glu(_product(e.linear_fc1, tokens), p))
            for e, tokens, p in zip(
                experts, torch.split(hidden, counts), torch.split(probs, counts), strict=True
            )
        ]
        return torch.cat(outputs, dim=0)


def _product(linear, x: torch.Tensor) -> torch.Tensor:
    """What one expert linear computes on its tokens: ``x·Wᵀ``, plus its LoRA adapter's product."""
    out = F.linear(x, linear.weight)
    if has_adapter(linear):
        low = F.linear(linear.lora_dropout(x), linear.lora_a)
        out = out + linear.lora_scale * F.linear(low, linear.lora_b)
    return out


def _grouped_product(linears: list, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`_product` of every expert on its rows of ``x`` (sorted by expert, ``offsets`` their ends) as
    grouped matrix products: the stacked weights, then the stacked adapters' two factors."""
    weights = torch.stack([linear.weight for linear in linears])  # [E, out, in]
    out = torch._grouped_mm(x, weights.transpose(1, 2), offs=offsets)
    first = linears[0]
    if has_adapter(first):
        a = torch.stack([linear.lora_a for linear in linears])  # [E, rank, in]
        b = torch.stack([linear.lora_b for linear in linears])  # [E, out, rank]
        low = torch._grouped_mm(first.lora_dropout(x), a.transpose(1, 2), offs=offsets)
        out = out + first.lora_scale * torch._grouped_mm(low, b.transpose(1, 2), offs=offsets)
    return out
