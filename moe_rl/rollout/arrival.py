"""How a Megatron engine's rollout recipe takes the weights a sync brings (`arrival_of`, chosen
once per engine): as they arrive, already the recipe's values (bytes quantized on the wire, decoded;
or no recipe); through ModelOpt's fake quantization on the engine's side (`FakeQuantized`); or,
for ``int4_awq``, calibrated on the engine's own rollouts (`AwqCalibrated`: ModelOpt's AWQ-lite
searches per-channel scales on `quant.calib_tokens` tokens of the most recent rollout sequences in a
scratch copy of the model, and the engine loads the effective dequantized weights; the first sync,
before any rollout, calibrates at the next generation on its prompts)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import torch

from moe_rl.config.modes import QuantMethod
from moe_rl.config.schema import RecipeConfig
from moe_rl.config.sync_plan import WIRE_METHODS
from moe_rl.megatron.decoding import pack_sequences
from moe_rl.quant.recipes import QuantReport, WeightQuantizer, awq_effective_weights, should_quantize
from moe_rl.rollout.engine import WHOLE_MODEL

log = logging.getLogger(__name__)


class Receiving(Protocol):
    """The engine the weights arrive in (`moe_rl.rollout.megatron_engine.MegatronEngine`)."""

    model: torch.nn.Module
    device: torch.device
    last_quant_report: QuantReport | None
    """The last sync's quantization report (set here)."""

    @property
    def loaded_bytes(self) -> int:
        """Bytes the engine's receiver loaded in the sync so far."""


def calibration_chunks(sequences: Sequence[list[int]], budget: int) -> list[list[list[int]]]:
    """Up to `budget` tokens of `sequences` (whole sequences, in order), packed ~512 tokens a chunk."""
    if not sequences:
        raise ValueError("int4_awq calibration needs at least one token sequence")
    chunks: list[list[list[int]]] = [[]]
    used = filled = 0
    for seq in sequences:
        seq = list(seq)[: budget - used]
        if not seq:
            break
        if filled and filled + len(seq) > 512:
            chunks.append([])
            filled = 0
        chunks[-1].append(seq)
        used += len(seq)
        filled += len(seq)
    return chunks


class Arrival:
    """How the engine's rollout recipe takes the weights a sync brings (`arrival_of`, chosen once):
    here, as they arrive, already the values the recipe gives (its quantized bytes decoded, or no
    recipe). Every recipe's weights are loaded through the engine's one `ModelReceiver`, whose
    `finish` checks the sync is complete."""

    def begin(self) -> None:
        """A sync begins."""

    def take(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """What the receiver loads of ``named`` (one bucket's decoded weights)."""
        return named

    def finish(self, engine: Receiving, version: int) -> dict:
        """The sync's numbers, once every weight is loaded."""
        return {"bytes_loaded": float(engine.loaded_bytes)}

    def before_generate(self, engine: Receiving, prompts: list[list[int]]) -> None:
        """Before a generation (a recipe that calibrates on rollouts may still have to)."""

    def after_generate(self, sequences: list[list[int]]) -> None:
        """After a generation: its sequences (prompt and response)."""


class FakeQuantized(Arrival):
    """ModelOpt's fake quantization of the recipe (quantize, dequantize) on the engine's side, for a
    recipe whose bytes do not travel quantized (NVFP4; none, which passes every weight as it is); what
    it gives is the sync's `QuantReport`."""

    def __init__(self, config: RecipeConfig):
        self.quantizer = WeightQuantizer(config.quant, config.model.num_layers)
        self.name = config.quant.name
        self.report = QuantReport(self.name)

    def begin(self) -> None:
        self.report = QuantReport(self.name)

    def take(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return self.quantizer.fake_quantize(named, self.report)

    def finish(self, engine: Receiving, version: int) -> dict:
        engine.last_quant_report = self.report
        return {**super().finish(engine, version), **self.report.summary()}


class AwqCalibrated(Arrival):
    """INT4 AWQ: the weights load as they arrive (so the sync is checked complete) and a copy is kept;
    the effective INT4 weights are calibrated on the engine's own last rollouts when the sync finishes,
    or, before any rollout, on the prompts of the next generation."""

    def __init__(self, config: RecipeConfig):
        self.config = config
        self.pending: dict[str, torch.Tensor] | None = None
        self.calibration: list[list[int]] = []

    def begin(self) -> None:
        self.pending = {}

    def take(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            self.pending[name] = tensor.clone()
            yield name, tensor

    def finish(self, engine: Receiving, version: int) -> dict:
        if not self.calibration:
            log.info("int4_awq: calibration of version %d runs at the next generate", version)
            return {"quant/recipe": self.config.quant.name}
        start = time.perf_counter()
        report = self.apply(engine, self.calibration)
        return {"seconds": time.perf_counter() - start, **report.summary()}

    def before_generate(self, engine: Receiving, prompts: list[list[int]]) -> None:
        if self.pending is not None:
            self.apply(engine, self.calibration or prompts)

    def after_generate(self, sequences: list[list[int]]) -> None:
        self.calibration = sequences

    @torch.no_grad()
    def apply(self, engine: Receiving, sequences: Sequence[list[int]]) -> QuantReport:
        """AWQ-calibrate the pending weights on `sequences` and load the effective INT4 weights."""
        from moe_rl.megatron.forward import forward_logits
        from moe_rl.megatron.hf_weights import hf_names_for, iter_hf_weights, load_hf_weights
        from moe_rl.megatron.model import build_gpt_model
        from moe_rl.megatron.replay import release_router_replay

        weights, cfg = self.pending, self.config.quant
        num_layers = self.config.model.num_layers
        scratch = build_gpt_model(self.config.model, WHOLE_MODEL, self.config.trainer)
        release_router_replay(scratch)
        load_hf_weights(scratch, weights)
        scratch.eval()
        chunks = calibration_chunks(sequences, cfg.calib_tokens)

        def forward_loop(model):
            for chunk in chunks:
                forward_logits(model, pack_sequences(chunk, engine.device))

        def include(name: str, weight: torch.Tensor) -> bool:
            hf = hf_names_for(engine.model, name).hf
            return all(should_quantize(h, weight, cfg, num_layers) for h in hf)

        effective = awq_effective_weights(scratch, cfg, forward_loop, include)
        del scratch
        load_hf_weights(engine.model, weights)
        params = dict(engine.model.named_parameters())
        quantized = set()
        for name, value in effective.items():
            params[name].copy_(value)
            quantized.update(hf_names_for(engine.model, name).hf)
        report = QuantReport(cfg.name)
        for name, sent in iter_hf_weights(engine.model):
            report.add(name, weights[name], sent if name in quantized else None, 4)
        self.pending = None
        engine.last_quant_report = report
        return report


def arrival_of(config: RecipeConfig) -> Arrival:
    """The one place the engine's handling of a recipe is chosen: AWQ calibrates here, a recipe whose
    bytes travel quantized (`WIRE_METHODS`) loads as it arrives, the others (no recipe included, whose
    report says what was loaded) go through ModelOpt's fake quantization here."""
    method = config.quant.method
    if method == QuantMethod.INT4_AWQ:
        return AwqCalibrated(config)
    if method in WIRE_METHODS:
        return Arrival()
    return FakeQuantized(config)
