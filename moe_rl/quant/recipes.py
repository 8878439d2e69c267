"""Rollout weight quantization recipes, done by NVIDIA ModelOpt.

At each weight sync the trainer's weights pass through the recipe of `rollout.quant`:

- engines that run quantized kernels (vLLM CUDA build) get real low-precision tensors (block FP8:
  e4m3 weights plus one fp32 scale per 128x128 block, the layout of vLLM's block-FP8 linear
  method, `weight` + `weight_scale_inv`, from `moe_rl.quant.fp8_block.quantize_fp8_block` through
  `moe_rl.quant.codec`);
- engines that cannot (the Megatron engine on CPU) get fake-quantized weights
  (`fake_quantize`: quantize then dequantize with ModelOpt's `TensorQuantizer`), so they compute
  with exactly the values a quantized engine would hold.

Routers, embeddings, the LM head, norms and biases stay unquantized by default
(`quant.exclude`), as do the first / last N layers when asked. Every sync reports the error of
what it sent (`QuantReport`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from moe_rl.config.modes import Granularity, QuantMethod
from moe_rl.config.schema import QuantConfig
from moe_rl.quant.rules import cuda_rule

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
FP8_E4M3_MAX = 448.0


@dataclass
class QuantReport:
    """What one sync sent: counts, bytes and the relative error of the quantized weights."""

    recipe: str
    num_quantized: int = 0
    num_kept: int = 0
    bytes_full: int = 0
    bytes_sent: int = 0
    err_sq: float = 0.0
    ref_sq: float = 0.0
    max_rel_err: float = 0.0
    worst_tensor: str = ""
    per_tensor: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, original: torch.Tensor, sent: torch.Tensor | None, bits: float) -> None:
        """One tensor of the sync: kept (``sent`` None) or quantized to ``sent`` at ``bits`` per weight."""
        if sent is None:
            self.num_kept += 1
            self.bytes_full += original.numel() * original.element_size()
            self.bytes_sent += original.numel() * original.element_size()
            return
        err_sq = float((sent.float() - original.float()).pow(2).sum())
        self.add_quantized(name, original, err_sq, float(original.float().pow(2).sum()), bits)

    def add_quantized(
        self, name: str, original: torch.Tensor, err_sq: float, ref_sq: float, bits: float
    ) -> None:
        """A quantized tensor whose squared error and squared norm the caller measured (e.g. in
        chunks, without full-size float copies)."""
        self.bytes_full += original.numel() * original.element_size()
        self.num_quantized += 1
        self.bytes_sent += int(original.numel() * bits / 8)
        self.err_sq += err_sq
        self.ref_sq += ref_sq
        rel = (err_sq / max(ref_sq, 1e-30)) ** 0.5
        self.per_tensor[name] = rel
        if rel >= self.max_rel_err:
            self.max_rel_err, self.worst_tensor = rel, name

    @property
    def rel_err(self) -> float:
        """Relative Frobenius error over every quantized tensor together."""
        return (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq else 0.0

    def merge(self, other: QuantReport) -> QuantReport:
        """Add another sender's report of the same sync (expert / pipeline owners send their own)."""
        for name in ("num_quantized", "num_kept", "bytes_full", "bytes_sent", "err_sq", "ref_sq"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.per_tensor.update(other.per_tensor)
        if other.max_rel_err >= self.max_rel_err:
            self.max_rel_err, self.worst_tensor = other.max_rel_err, other.worst_tensor
        return self

    def summary(self) -> dict[str, float | int | str]:
        return {
            "quant/recipe": self.recipe,
            "quant/num_quantized": self.num_quantized,
            "quant/num_kept": self.num_kept,
            "quant/rel_err": self.rel_err,
            "quant/max_rel_err": self.max_rel_err,
            "quant/bytes_sent": self.bytes_sent,
            "quant/compression": self.bytes_full / max(self.bytes_sent, 1),
        }


def _bits(cfg: QuantConfig) -> float:
    return {"none": 16.0, "fp8": 8.0, "int8": 8.0, "int4_awq": 4.0, "nvfp4": 4.0}[cfg.method]


def quantizer_attributes(cfg: QuantConfig) -> dict:
    """ModelOpt `QuantizerAttributeConfig` arguments of the recipe's weight quantizer."""
    block = cfg.block_size
    if cfg.method == QuantMethod.FP8:
        if cfg.granularity == Granularity.BLOCK:
            return {"num_bits": (4, 3), "block_sizes": {-1: block, -2: block}}
        if cfg.granularity == Granularity.CHANNEL:
            return {"num_bits": (4, 3), "axis": 0}
        return {"num_bits": (4, 3), "axis": None}
    if cfg.method == QuantMethod.INT8:
        return {"num_bits": 8, "axis": 0 if cfg.granularity == Granularity.CHANNEL else None}
    if cfg.method == QuantMethod.INT4_AWQ:
        return {"num_bits": 4, "block_sizes": {-1: block}}
    if cfg.method == QuantMethod.NVFP4:
        return {"num_bits": (2, 1), "block_sizes": {-1: block, "type": "dynamic", "scale_bits": (4, 3)}}
    raise ValueError(f"quant.method='{cfg.method}' has no weight quantizer")


def check_quant_supported(cfg: QuantConfig, cuda: bool) -> None:
    """Refuse a recipe this machine cannot run (`moe_rl.quant.rules.cuda_rule`), naming the
    alternatives."""
    rule = cuda_rule(cfg, cuda)
    if rule.broken:
        raise ValueError(rule.detail)


ADAPTER_HF = (".lora_A.weight", ".lora_B.weight")
"""How the HF names of LoRA adapter tensors end (PEFT's names, `moe_rl.megatron.hf_weights`). No
recipe quantizes them: an engine applies the adapters in their own precision, as vLLM's LoRA does."""


def should_quantize(name: str, tensor: torch.Tensor, cfg: QuantConfig, num_layers: int) -> bool:
    """Whether parameter `name` is quantized by the recipe (2-D weights outside the exclusions; not
    an adapter's)."""
    if cfg.method == QuantMethod.NONE or tensor.dim() != 2 or not tensor.is_floating_point():
        return False
    if name.endswith(ADAPTER_HF):
        return False
    if any(fnmatch.fnmatch(name, pattern) for pattern in cfg.exclude):
        return False
    match = _LAYER.search(name)
    if match:
        layer = int(match.group(1))
        if layer < cfg.exclude_first_layers or layer >= num_layers - cfg.exclude_last_layers:
            return False
    return True


class WeightQuantizer:
    """Fake-quantizes (quantize → dequantize) named weights with ModelOpt's `TensorQuantizer`."""

    def __init__(self, cfg: QuantConfig, num_layers: int):
        self.cfg = cfg
        self.num_layers = num_layers
        self._attrs = quantizer_attributes(cfg) if cfg.method != QuantMethod.NONE else None

    def _qdq(self, weight: torch.Tensor) -> torch.Tensor:
        from modelopt.torch.quantization.config import QuantizerAttributeConfig
        from modelopt.torch.quantization.nn import TensorQuantizer

        quantizer = TensorQuantizer(QuantizerAttributeConfig(**self._attrs))
        with torch.no_grad():
            return quantizer(weight.float()).to(weight.dtype)

    def fake_quantize(
        self, named: Iterable[tuple[str, torch.Tensor]], report: QuantReport | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` with quantized weights replaced by their dequantized values."""
        for name, tensor in named:
            if self._attrs is None or not should_quantize(name, tensor, self.cfg, self.num_layers):
                if report is not None:
                    report.add(name, tensor, None, 16)
                yield name, tensor
                continue
            sent = self._qdq(tensor)
            if report is not None:
                report.add(name, tensor, sent, _bits(self.cfg))
            yield name, sent


def awq_quant_config(cfg: QuantConfig, excluded_modules: Iterable[str]) -> dict:
    """ModelOpt's ``INT4_AWQ_CFG`` with the recipe's block size and its excluded modules disabled."""
    import copy

    import modelopt.torch.quantization as mtq

    qcfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    entries = qcfg["quant_cfg"]
    for entry in entries:
        if entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry:
            entry["cfg"]["block_sizes"] = {**entry["cfg"]["block_sizes"], -1: cfg.block_size}
    entries.extend({"quantizer_name": f"{m}.weight_quantizer", "enable": False} for m in excluded_modules)
    return qcfg


@torch.no_grad()
def awq_effective_weights(
    model: torch.nn.Module,
    cfg: QuantConfig,
    forward_loop,
    include,
) -> dict[str, torch.Tensor]:
    """Calibrate `model` with ModelOpt AWQ-lite and return the weights an INT4-AWQ engine computes with.

    ``include(param_name, weight)`` says which linear weights the recipe quantizes; the others get
    their quantizers disabled before calibration. ``forward_loop(model)`` runs the calibration
    data. ``model`` is consumed: ModelOpt inserts quantizers and rescales its weights in place.

    AWQ multiplies each linear's input by ``p`` (the input quantizer's ``pre_quant_scale``) and
    divides the weight's columns by it before the INT4 block quantizer ``Q``, so the layer computes
    ``(x·p) Q(W/p)ᵀ = x (Q(W/p)·p)ᵀ``. The returned ``{param_name: Q(W/p)·p}`` is that effective
    weight, which a plain model loads to compute exactly what the quantized engine computes.
    """
    import modelopt.torch.quantization as mtq

    if cfg.method != QuantMethod.INT4_AWQ:
        raise ValueError(f"AWQ calibration is for quant.method=int4_awq, got '{cfg.method}'")
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 2
    }
    excluded = [name for name, module in linears.items() if not include(f"{name}.weight", module.weight)]
    mtq.quantize(model, awq_quant_config(cfg, excluded), forward_loop)
    effective = {}
    for name, module in model.named_modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is None or not quantizer.is_enabled:
            continue
        if name not in linears:
            raise ValueError(
                f"ModelOpt quantized {name!r}, which has no single 2-D `weight` (grouped experts are "
                "not supported by the AWQ recipe of the Megatron engine)"
            )
        weight = quantizer(module.weight.float())
        input_quantizer = getattr(module, "input_quantizer", None)
        scale = getattr(input_quantizer, "pre_quant_scale", None)
        if scale is not None and getattr(input_quantizer, "_enable_pre_quant_scale", False):
            weight = weight * scale.float().reshape(1, -1)
        effective[f"{name}.weight"] = weight.to(module.weight.dtype)
    return effective
