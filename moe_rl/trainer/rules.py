"""What the trainer can run: its rules on a recipe, in one place, without importing torch.

The trainer enforces these (the worker checks them when it starts; parallel init and routing
replay refuse the layouts they cannot build), and `moe_rl.validation` calls the same functions
before anything loads, so `plan`, `config check`, `submit` and `train` refuse the same recipes.
`trainer_rules` returns every rule with its numbers (what `moe-rl plan` prints);
`check_trainer` raises the first broken one.
"""

from __future__ import annotations

from moe_rl.config.schema import ParallelConfig, RecipeConfig
from moe_rl.validation import Rule, first_broken


def _divisible(name: str, value: int, value_name: str, divisor: int, divisor_name: str) -> Rule:
    ok = divisor > 0 and value % divisor == 0
    verb = "is" if ok else "is not"
    return Rule(name, ok, f"{value_name}={value} {verb} divisible by {divisor_name}={divisor}")


def data_parallel_size(p: ParallelConfig) -> int:
    return max(1, p.trainer_world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                                          * p.context_parallel_size))  # fmt: skip


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
        _divisible("world % (TP*PP*CP)", p.trainer_world_size, "parallel.trainer_world_size", tp * pp * cp, model_parallel),
        _divisible("world % (EP*ETP*PP)", p.trainer_world_size, "parallel.trainer_world_size", ep * etp * pp,
                   expert_parallel),
        Rule("sequence parallel needs TP > 1", not p.sequence_parallel or tp > 1,
             f"parallel.sequence_parallel={p.sequence_parallel}, TP={tp}"),
        Rule("EP with TP needs sequence parallel", not (ep > 1 and tp > 1) or p.sequence_parallel,
             f"EP={ep}, TP={tp}, parallel.sequence_parallel={p.sequence_parallel} (Megatron's MoE layer)"),
        Rule("no virtual pipeline stages", p.virtual_pipeline_model_parallel_size in (None, 1),
             f"parallel.virtual_pipeline_model_parallel_size={p.virtual_pipeline_model_parallel_size}: the trainer "
             "runs Megatron's non-interleaved 1F1B schedule; use null"),
    ]  # fmt: skip


def _model_rules(config: RecipeConfig) -> list[Rule]:
    m, p = config.model, config.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    rules = [_divisible("heads % TP", m.num_attention_heads, "model.num_attention_heads", tp, "TP")]
    if m.attention == "gqa":
        rules.append(
            _divisible("query groups % TP", m.num_key_value_heads, "model.num_key_value_heads", tp, "TP")
        )
    rules.append(_divisible("layers % PP", m.num_layers, "model.num_layers", pp, "PP"))
    if m.first_k_dense_layers or m.num_experts == 0:
        rules.append(_divisible("dense FFN % TP", m.ffn_hidden_size, "model.ffn_hidden_size", tp, "TP"))
    if m.num_experts:
        rules.append(
            _divisible(
                "experts % EP",
                m.num_experts,
                "model.num_experts",
                p.expert_model_parallel_size,
                "EP (parallel.expert_model_parallel_size)",
            )
        )
        rules.append(_divisible("expert FFN % ETP", m.moe_ffn_hidden_size, "model.moe_ffn_hidden_size",
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


def longest_sequence(config: RecipeConfig) -> int:
    """The longest sequence a rollout can produce (prompt + response)."""
    return config.data.max_prompt_len + config.rollout.max_new_tokens


def _batch_rules(config: RecipeConfig) -> list[Rule]:
    p, t, r = config.parallel, config.trainer, config.rollout
    dp, cp = data_parallel_size(p), p.context_parallel_size
    rules = [
        _divisible("batch % (mini-batches*DP)", r.batch_size, "rollout.batch_size", t.num_mini_batches * dp,
                   f"trainer.num_mini_batches*DP (trainer.num_mini_batches={t.num_mini_batches}, data-parallel size {dp})"),
        Rule("micro-batch holds a sequence", t.max_tokens_per_microbatch >= longest_sequence(config),
             f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch}, longest sequence "
             f"{longest_sequence(config)} (data.max_prompt_len + rollout.max_new_tokens)"),
    ]  # fmt: skip
    if cp > 1:
        chunks = 2 * cp * (p.tensor_model_parallel_size if p.sequence_parallel else 1)
        rules.append(_divisible("micro-batch % CP chunks", t.max_tokens_per_microbatch,
                                "trainer.max_tokens_per_microbatch", chunks, "2*CP(*TP with SP)"))  # fmt: skip
    return rules


def replay_layout_error(routing_replay: str, context_parallel_size: int) -> str | None:
    """Routing replay replays per packed token; a context-parallel rank holds only a slice."""
    if routing_replay != "off" and context_parallel_size > 1:
        return (
            f"algo.routing_replay={routing_replay} with parallel.context_parallel_size={context_parallel_size}: "
            "routing replay does not support context parallelism; use context_parallel_size=1 or "
            "algo.routing_replay=off"
        )
    return None


def _algo_rules(config: RecipeConfig) -> list[Rule]:
    a, t = config.algo, config.trainer
    replay_error = replay_layout_error(a.routing_replay, config.parallel.context_parallel_size)
    return [
        Rule("replay without context parallelism", replay_error is None,
             replay_error or f"algo.routing_replay={a.routing_replay}, CP={config.parallel.context_parallel_size}"),
        Rule("replay without the fused router", a.routing_replay == "off" or not t.moe_router_fusion,
             f"algo.routing_replay={a.routing_replay} with trainer.moe_router_fusion={t.moe_router_fusion}: the fused "
             "router skips Megatron's RouterReplay silently; set trainer.moe_router_fusion=false"),
        Rule("ESPO has the old policy's entropy", a.objective != "espo" or t.compute_entropy,
             f"algo.objective={a.objective} needs trainer.compute_entropy=true (entropy of π_old), "
             f"got {t.compute_entropy}"),
        Rule("no reference model", a.kl.coef == 0,
             f"algo.kl.coef={a.kl.coef}: the trainer keeps no reference model; use 0"),
        Rule("no zero-variance shaping", not a.zero_variance_shaping,
             f"algo.zero_variance_shaping={a.zero_variance_shaping}: the RL loop does not apply it yet"),
    ]  # fmt: skip


def trainer_rules(config: RecipeConfig) -> list[Rule]:
    """Every rule of the trainer on ``config``, with its numbers."""
    return layout_rules(config.parallel) + _model_rules(config) + _batch_rules(config) + _algo_rules(config)


def check_trainer(config: RecipeConfig) -> None:
    """Raise ``ValueError`` with the first broken trainer rule."""
    first_broken(trainer_rules(config))


def check_layout(parallel: ParallelConfig, world_size: int) -> None:
    """The layout rules for the world a process actually joined (parallel init)."""
    import dataclasses

    first_broken(layout_rules(dataclasses.replace(parallel, trainer_world_size=world_size)))
