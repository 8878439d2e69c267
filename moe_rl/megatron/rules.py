"""The rules of the Megatron layer on a recipe: how the world splits into TP / PP / EP / ETP / CP /
DP, what the model's shapes must divide, what routing replay can replay, which Hugging Face
checkpoints it converts (`HF_ARCHITECTURES`, `checkpoint_rule`). Parallel init, `RoutingReplay`
and the weight loader enforce them at run time; the trainer's rules (`moe_rl.trainer.rules`)
include the layout's, and the preflight (`moe_rl.orchestration.preflight`) calls them before
anything loads. Imports no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from moe_rl.config.modes import Attention, Family, ReplayMode
from moe_rl.config.schema import ModelConfig, ParallelConfig, RecipeConfig
from moe_rl.rules import Rule, divisible, first_broken

HF_ARCHITECTURES: dict[Family, str] = {
    Family.QWEN3_MOE: "Qwen3MoeForCausalLM",
    Family.DEEPSEEK_V3: "DeepseekV3ForCausalLM",
}
"""The Hugging Face architecture of each model family: what the Megatron layer builds for it and
converts weights of (`moe_rl.megatron.hf_weights`), and what it writes in a ``config.json``
(`moe_rl.megatron.model.model_config_to_hf_config`). Kimi-K2 is a ``DeepseekV3ForCausalLM``."""


def layout_rules(p: ParallelConfig) -> list[Rule]:
    """How the world splits (what Megatron's parallel state needs)."""
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    model_parallel = (
        f"TP*PP*CP (parallel.tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}, "
        f"context_parallel_size={cp})"
    )
    expert_parallel = (
        f"EP*ETP*PP (parallel.expert_model_parallel_size={ep}, expert_tensor_parallel_size={etp}, "
        f"pipeline_model_parallel_size={pp})"
    )
    return [
        divisible("world % (TP*PP*CP)", p.trainer_world_size, "parallel.trainer_world_size", tp * pp * cp, model_parallel),
        divisible("world % (EP*ETP*PP)", p.trainer_world_size, "parallel.trainer_world_size", ep * etp * pp,
                   expert_parallel),
        Rule("sequence parallel needs TP > 1", not p.sequence_parallel or tp > 1,
             f"parallel.sequence_parallel={p.sequence_parallel}, TP={tp}"),
        Rule("EP with TP needs sequence parallel", not (ep > 1 and tp > 1) or p.sequence_parallel,
             f"EP={ep}, TP={tp}, parallel.sequence_parallel={p.sequence_parallel} (Megatron's MoE layer)"),
        Rule("no virtual pipeline stages", p.virtual_pipeline_model_parallel_size in (None, 1),
             f"parallel.virtual_pipeline_model_parallel_size={p.virtual_pipeline_model_parallel_size}",
             advice="the trainer runs Megatron's non-interleaved 1F1B schedule; use null"),
    ]  # fmt: skip


def model_rules(config: RecipeConfig) -> list[Rule]:
    m, p = config.model, config.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    rules = [divisible("heads % TP", m.num_attention_heads, "model.num_attention_heads", tp, "TP")]
    if m.attention == Attention.GQA:
        rules.append(
            divisible("query groups % TP", m.num_key_value_heads, "model.num_key_value_heads", tp, "TP")
        )
    rules.append(divisible("layers % PP", m.num_layers, "model.num_layers", pp, "PP"))
    if m.first_k_dense_layers or m.num_experts == 0:
        rules.append(divisible("dense FFN % TP", m.ffn_hidden_size, "model.ffn_hidden_size", tp, "TP"))
    if m.num_experts:
        rules.append(
            divisible(
                "experts % EP",
                m.num_experts,
                "model.num_experts",
                p.expert_model_parallel_size,
                "EP (parallel.expert_model_parallel_size)",
            )
        )
        rules.append(divisible("expert FFN % ETP", m.moe_ffn_hidden_size, "model.moe_ffn_hidden_size",
                                p.expert_tensor_parallel_size, "ETP"))  # fmt: skip
    if m.num_experts and m.moe_router_num_groups:
        groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk or 1
        per_group = m.num_experts // groups if m.num_experts % groups == 0 else 0
        ok = per_group > 0 and group_topk <= groups and m.moe_router_topk <= group_topk * per_group
        rules.append(Rule("router groups", ok,
                          f"{m.num_experts} experts in {groups} groups of {per_group}; a token uses {group_topk} "
                          f"groups and top-{m.moe_router_topk} experts (needs experts % groups == 0, group_topk "
                          "<= groups, topk <= group_topk * experts per group)"))  # fmt: skip
    return rules


def replay_layout_error(routing_replay: str, context_parallel_size: int) -> str | None:
    """Routing replay replays per packed token; a context-parallel rank holds only a slice."""
    if routing_replay != ReplayMode.OFF and context_parallel_size > 1:
        return (
            f"algo.routing_replay={routing_replay} with parallel.context_parallel_size={context_parallel_size}: "
            "routing replay does not support context parallelism; use context_parallel_size=1 or "
            "algo.routing_replay=off"
        )
    return None


def check_layout(parallel: ParallelConfig, world_size: int) -> None:
    """The layout rules for the world a process actually joined (parallel init)."""
    import dataclasses

    first_broken(layout_rules(dataclasses.replace(parallel, trainer_world_size=world_size)))


def checkpoint_rule(model: ModelConfig, folder: Path) -> Rule:
    """`model.hf_path` (a folder with ``config.json`` and ``*.safetensors``, as this machine sees
    it) holds weights the trainer can load for ``model.family``: its ``config.json`` names the
    family's architecture (`HF_ARCHITECTURES`), and every ``*.safetensors`` file has a safetensors
    header (read alone, no tensor loaded). Refused, the line names the architecture the folder has
    and the supported ones: the weights of another architecture would fail to load once the run
    has started, with names the trainer does not know."""
    key = f"model.hf_path={folder}"
    want = HF_ARCHITECTURES[model.family]
    supported = ", ".join(f"{arch} (model.family={family})" for family, arch in HF_ARCHITECTURES.items())
    try:
        hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Rule("model checkpoint", False, f"{key}: config.json is not JSON ({exc})")
    except OSError as exc:
        return Rule("model checkpoint", False, f"{key}: config.json cannot be read ({exc.strerror or exc})")
    named = hf_config.get("architectures") if isinstance(hf_config, dict) else None
    if not isinstance(named, list) or want not in named:
        has = (
            ", ".join(map(str, named)) if isinstance(named, list) and named
            else f"no architecture (model_type={hf_config.get('model_type') if isinstance(hf_config, dict) else None})"
        )  # fmt: skip
        return Rule(
            "model checkpoint", False, f"{key}: config.json names {has}",
            advice=f"the trainer converts {supported}; model.family={model.family} needs {want}",
        )  # fmt: skip
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem is not None:
            return Rule(
                "model checkpoint", False, f"{key}: {path.name} is not a safetensors file ({problem})"
            )
    return Rule("model checkpoint", True, f"{key}: {want} for model.family={model.family}")


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` has no readable safetensors header (None: it has one). safetensors' own reader
    opens it and reads the header only; no tensor is loaded, no torch imported."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):
            return None
    except SafetensorError as exc:
        return str(exc)
    except OSError as exc:
        return exc.strerror or str(exc)
