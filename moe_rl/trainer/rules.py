"""What the trainer can run: its rules on a recipe, in one place, without importing torch.

The Megatron layer's layout and replay rules (`moe_rl.megatron.rules`) plus the trainer's own:
batch packing and the objectives and corrections it applies. The worker checks them when it
starts, and the preflight (`moe_rl.orchestration.preflight`) calls the same functions before anything loads, so `plan`,
`config check`, `submit` and `train` refuse the same recipes.
`trainer_rules` returns every rule with its numbers (what `moe-rl plan` prints);
`check_trainer` raises the first broken one.
"""

from __future__ import annotations

from moe_rl.algo.modes import OFFLINE_OBJECTIVES, Divergence, Objective, PolicyMode, TISMode
from moe_rl.config.derived import data_parallel_size, longest_sequence, response_limit_key, sampling_truncates
from moe_rl.config.modes import LoraTarget, ReplayMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.megatron.rules import layout_rules, model_rules, replay_layout_error
from moe_rl.rules import Rule, divisible, first_broken


def _batch_rules(config: RecipeConfig) -> list[Rule]:
    p, t, r = config.parallel, config.trainer, config.rollout
    dp, cp = data_parallel_size(p), p.context_parallel_size
    rules = [
        divisible("batch % (mini-batches*DP)", r.batch_size, "rollout.batch_size", t.num_mini_batches * dp,
                   f"trainer.num_mini_batches*DP (trainer.num_mini_batches={t.num_mini_batches}, data-parallel size {dp})"),
        Rule("micro-batch holds a sequence", t.max_tokens_per_microbatch >= longest_sequence(config),
             f"trainer.max_tokens_per_microbatch={t.max_tokens_per_microbatch}, longest sequence "
             f"{longest_sequence(config)} (data.max_prompt_len + {response_limit_key(config)})"),
    ]  # fmt: skip
    if cp > 1:
        chunks = 2 * cp * (p.tensor_model_parallel_size if p.sequence_parallel else 1)
        rules.append(divisible("micro-batch % CP chunks", t.max_tokens_per_microbatch,
                                "trainer.max_tokens_per_microbatch", chunks, "2*CP(*TP with SP)"))  # fmt: skip
    return rules


def _correction_rules(config: RecipeConfig) -> list[Rule]:
    c, r = config.algo.corrections, config.rollout
    rej = c.rejection
    return [
        Rule("bypass ratio over the kept tokens",
             config.algo.policy_mode != PolicyMode.BYPASS or not sampling_truncates(r.top_k, r.top_p)
             or c.keep_sampling_mask,
             f"algo.policy_mode={config.algo.policy_mode} with rollout.top_p={r.top_p}, rollout.top_k={r.top_k} "
             "and algo.corrections.keep_sampling_mask=false",
             fatal=False,
             advice="the engine's log-probs are over the kept tokens, the trainer's over the vocabulary, so the "
             "ratio π_θ/μ starts below 1 and the clip drops negative advantages (measured: learning stops on a "
             "plateau); set keep_sampling_mask=true"),
        Rule("one importance weight", not (c.icepop.enabled and c.tis.mode != TISMode.OFF),
             f"algo.corrections.icepop.enabled={c.icepop.enabled} with algo.corrections.tis.mode={c.tis.mode}",
             advice="both weight the loss by the rollout-vs-old ratio, which would count it twice; keep one"),
        Rule("rejection band fits its divergence", not rej.enabled or rej.divergence == Divergence.K1 or rej.low <= 0,
             f"algo.corrections.rejection.divergence={rej.divergence} with low={rej.low}",
             advice="k2 and k3 are >= 0 and 0 when on-policy, so a band starting above 0 rejects the most "
             "on-policy responses; set low=0 (the ratio band 0.999..1.001 is k1's)"),
    ]  # fmt: skip


def _algo_rules(config: RecipeConfig) -> list[Rule]:
    a, t = config.algo, config.trainer
    replay_error = replay_layout_error(a.routing_replay, config.parallel.context_parallel_size)
    return [
        *_correction_rules(config),
        Rule("replay without context parallelism", replay_error is None,
             replay_error or f"algo.routing_replay={a.routing_replay}, CP={config.parallel.context_parallel_size}"),
        Rule("replay without the fused router", a.routing_replay == ReplayMode.OFF or not t.moe_router_fusion,
             f"algo.routing_replay={a.routing_replay} with trainer.moe_router_fusion={t.moe_router_fusion}",
             advice="the fused router skips Megatron's RouterReplay silently; set trainer.moe_router_fusion=false"),
        Rule("ESPO has the old policy's entropy", a.objective != Objective.ESPO or t.compute_entropy,
             f"algo.objective={a.objective} needs trainer.compute_entropy=true (entropy of π_old), "
             f"got {t.compute_entropy}"),
        Rule("zero-variance shaping has the old policy's entropy", not a.zero_variance_shaping or t.compute_entropy,
             f"algo.zero_variance_shaping={a.zero_variance_shaping} needs trainer.compute_entropy=true "
             f"(RL-ZVP shapes advantages with π_old's entropy), got {t.compute_entropy}"),
        Rule("zero-variance shaping shapes advantages", not a.zero_variance_shaping or a.objective not in OFFLINE_OBJECTIVES,
             f"algo.zero_variance_shaping={a.zero_variance_shaping} with algo.objective={a.objective}",
             advice=f"{a.objective.name} trains on sample weights, not advantages; turn one of them off"),
    ]  # fmt: skip


def _lora_rules(config: RecipeConfig) -> list[Rule]:
    """LoRA (`moe_rl.megatron.lora`) on the trainer's layout: an expert's adapter is whole on its
    rank."""
    lora, p = config.lora, config.parallel
    if lora.rank == 0:
        return []
    return [
        Rule("LoRA on experts at expert TP 1", LoraTarget.EXPERTS not in lora.targets or p.expert_tensor_parallel_size == 1,
             f"lora.targets has experts with parallel.expert_tensor_parallel_size={p.expert_tensor_parallel_size}",
             advice="an expert's adapter is whole on the rank that holds the expert; set "
             "parallel.expert_tensor_parallel_size=1 or drop experts from lora.targets"),
    ]  # fmt: skip


def trainer_rules(config: RecipeConfig) -> list[Rule]:
    """Every rule of the trainer on ``config``, with its numbers."""
    return (
        layout_rules(config.parallel) + model_rules(config) + _batch_rules(config) + _algo_rules(config)
        + _lora_rules(config)
    )  # fmt: skip


def check_trainer(config: RecipeConfig) -> None:
    """Raise ``ValueError`` with the first broken trainer rule."""
    first_broken(trainer_rules(config))
