"""The recipe's own consistency: choices, finite numbers, ranges of sizes and counts, the run
name, batch shapes, correction bands. They run before any heavy import, so a bad recipe fails in
well under a second; every error names the field, its value and what would be valid.

`check_values` tests each field on its own (the `RANGES` table, finite floats, choices, the run
name); `load_recipe` runs it on everything it loads.

`recipe_rules` states these and the cross-field checks as rules. The rules of the components that
run a recipe (the trainer's layout, the engine's capabilities, placement, rewards) live with those
components; `moe_rl.orchestration.preflight` calls all of them.
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moe_rl.algo.modes import (
    GROUP_ADVANTAGES,
    OFFLINE_OBJECTIVES,
    TOKEN_ADVANTAGES,
    Advantage,
    Aggregation,
    KLEstimator,
    Objective,
)
from moe_rl.config.derived import longest_sequence, response_limit_key
from moe_rl.config.modes import Attention, CriticInit, Engine, LoraTarget, ReplayMode, RopeScaling, RunMode
from moe_rl.config.schema import CHOICES as MODES
from moe_rl.config.schema import CriticConfig, LoraConfig, ModelConfig, RecipeConfig
from moe_rl.errors import ConfigError, brief
from moe_rl.rules import Rule

CHOICES: dict[str, tuple[str, ...]] = {path: tuple(m.value for m in mode) for path, mode in MODES.items()}
"""Every choice field and its valid values (from its mode, `moe_rl.config.schema.CHOICES`)."""


@dataclass(frozen=True)
class ValueRange:
    """The values a field may take on its own: a test, and how an error message states it."""

    ok: Callable[[Any], bool]
    text: str


POSITIVE = ValueRange(lambda v: v > 0, "> 0")
NON_NEGATIVE = ValueRange(lambda v: v >= 0, ">= 0")
NULL_OR_POSITIVE = ValueRange(lambda v: v is None or v > 0, "null or > 0")
UNIT_FROM_ZERO = ValueRange(lambda v: 0 <= v < 1, "in [0, 1)")
UNIT_TO_ONE = ValueRange(lambda v: 0 < v <= 1, "in (0, 1]")


def _each(bound: ValueRange, *paths: str) -> dict[str, ValueRange]:
    return dict.fromkeys(paths, bound)


# Every numeric field whose valid values do not depend on other fields. Sizes and counts are > 0
# wherever 0 means nothing (every divisor among them); offsets, counters and intervals are >= 0.
RANGES: dict[str, ValueRange] = {
    **_each(POSITIVE, "run.steps", "run.async_depth"),
    **_each(NON_NEGATIVE, "run.seed", "run.max_staleness", "run.checkpoint_every"),
    **_each(POSITIVE, "model.vocab_size", "model.hidden_size", "model.num_layers",
            "model.num_attention_heads", "model.num_key_value_heads", "model.head_dim",
            "model.ffn_hidden_size", "model.moe_ffn_hidden_size", "model.kv_lora_rank",
            "model.qk_nope_head_dim", "model.qk_rope_head_dim", "model.v_head_dim", "model.rope_theta",
            "model.max_position_embeddings", "model.rms_norm_eps", "model.init_std"),
    **_each(NON_NEGATIVE, "model.num_experts", "model.first_k_dense_layers", "model.num_shared_experts",
            "model.moe_aux_loss_coeff"),
    **_each(NULL_OR_POSITIVE, "model.moe_router_num_groups", "model.moe_router_group_topk",
            "model.moe_router_topk_scaling_factor", "model.q_lora_rank"),
    **_each(POSITIVE, "parallel.trainer_world_size", "parallel.tensor_model_parallel_size",
            "parallel.pipeline_model_parallel_size", "parallel.expert_model_parallel_size",
            "parallel.expert_tensor_parallel_size", "parallel.context_parallel_size"),
    **_each(POSITIVE, "rollout.batch_size", "rollout.group_size", "rollout.max_new_tokens",
            "rollout.temperature", "rollout.num_engines", "rollout.tensor_parallel_size",
            "rollout.sync_bucket_mb", "rollout.max_model_len", "rollout.megatron_kv_cache_gib"),
    "rollout.top_k": ValueRange(lambda v: v == -1 or v > 0, "-1 (off) or > 0"),
    **_each(UNIT_TO_ONE, "rollout.top_p", "rollout.gpu_memory_utilization"),
    **_each(UNIT_TO_ONE, "cluster.train_mfu", "cluster.mean_length_fraction"),
    **_each(POSITIVE, "quant.block_size", "quant.calib_tokens"),
    **_each(NON_NEGATIVE, "quant.exclude_first_layers", "quant.exclude_last_layers"),
    **_each(UNIT_FROM_ZERO, "algo.clip_eps_low", "algo.gspo_eps_low"),
    **_each(NON_NEGATIVE, "algo.clip_eps_high", "algo.gspo_eps_high", "algo.espo_alpha"),
    "algo.espo_rho": ValueRange(lambda v: 0 < v < 1, "in (0, 1)"),
    **_each(POSITIVE, "algo.espo_num_groups", "algo.dgo_beta", "algo.corrections.tis.cap",
            "algo.dynamic_sampling_rounds"),
    "algo.kl.coef": NON_NEGATIVE,
    **_each(ValueRange(lambda v: 0 <= v <= 1, "in [0, 1]"), "algo.gae.gamma", "algo.gae.lam"),
    **_each(POSITIVE, "critic.lr", "critic.clip"),
    "algo.distill.coef": NON_NEGATIVE,
    "lora.rank": NON_NEGATIVE,
    "lora.alpha": POSITIVE,
    "lora.dropout": UNIT_FROM_ZERO,
    **_each(NON_NEGATIVE, "critic.weight_decay", "critic.grad_clip", "critic.warmup_steps"),
    **_each(POSITIVE, "trainer.lr", "trainer.num_mini_batches", "trainer.max_tokens_per_microbatch",
            "trainer.logprob_chunk_size", "trainer.adam_eps"),
    **_each(NON_NEGATIVE, "trainer.min_lr", "trainer.lr_warmup_steps", "trainer.weight_decay",
            "trainer.grad_clip"),
    **_each(UNIT_FROM_ZERO, "trainer.adam_beta1", "trainer.adam_beta2"),
    **_each(POSITIVE, "data.max_prompt_len", "data.offline_batches", "data.reward_workers",
            "data.reward_batch_size"),
    "data.reward_timeout_s": NULL_OR_POSITIVE,
    **_each(NON_NEGATIVE, "data.reward_retries", "data.reward_backoff_s"),
    **_each(POSITIVE, "env.max_turns", "env.max_tokens", "sft.num_demonstrations"),
    **_each(POSITIVE, "cluster.nodes", "cluster.trainer_nodes", "cluster.ray_join_timeout_s",
            "cluster.gpu_memory_gib"),
    **_each(NON_NEGATIVE, "cluster.gpus_per_node", "cluster.rollout_nodes", "cluster.signal_grace_s"),
    "cluster.ray_port": ValueRange(lambda v: 1 <= v <= 65535, "a TCP port in [1, 65535]"),
    **_each(NON_NEGATIVE, "logging.diagnose_every"),
}  # fmt: skip

UNBOUNDED: tuple[str, ...] = (
    "algo.corrections.tis.cap",
    "algo.corrections.icepop.high",
    "algo.corrections.rejection.low",
    "algo.corrections.rejection.high",
    "critic.clip",
)
"""Float fields where .inf / -.inf means "no bound" (as in `moe_rl.algo.corrections`); every other
float field must be finite."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _float_paths(cls: type = RecipeConfig, prefix: str = "") -> list[str]:
    """Paths of the schema's `float` and `float | None` fields."""
    paths: list[str] = []
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            paths += _float_paths(tp, f"{prefix}{name}.")
        elif tp is float or float in typing.get_args(tp):
            paths.append(f"{prefix}{name}")
    return paths


FLOATS: tuple[str, ...] = tuple(_float_paths())


def _get(config: RecipeConfig, path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_text(field: str, value: str | None) -> None:
    """Refuse a control character (newline, tab, ...) in a value that becomes a file name or a
    line of a script."""
    _require(
        value is None or not _CONTROL.search(value),
        f"{field}={brief(value)} contains a control character (newline, tab, ...)",
    )


def _check_finite(config: RecipeConfig) -> None:
    for path in FLOATS:
        value = _get(config, path)
        if value is None:
            continue
        if path in UNBOUNDED:
            _require(not math.isnan(value), f"{path}={value} must be a number (.inf or -.inf: no bound)")
        else:
            _require(math.isfinite(value), f"{path}={value} must be a finite number")


def _check_choices(config: RecipeConfig) -> None:
    for path, valid in CHOICES.items():
        value = _get(config, path)
        _require(value in valid, f"{path}={brief(value)} is not one of: {', '.join(valid)}")


def _check_ranges(config: RecipeConfig) -> None:
    for path, bound in RANGES.items():
        value = _get(config, path)
        _require(bound.ok(value), f"{path}={brief(value)} must be {bound.text}")


def _check_run_name(name: str) -> None:
    """The run directory is `<run.output_dir>/<run.name>`, and Slurm log paths are built from it."""
    check_text("run.name", name)
    _require(
        name not in ("", ".", "..") and "/" not in name and "\\" not in name,
        f"run.name={brief(name)} must be a plain folder name inside run.output_dir (no `/` or `\\`; "
        "not empty, `.` or `..`)",
    )
    _require(
        "%" not in name,
        f"run.name={brief(name)} must not contain `%`: sbatch and srun expand %j, %N, ... in the job's log paths",
    )


_SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def check_slurm_time(text: str) -> None:
    """``cluster.time`` in a form sbatch reads: ``minutes``, ``minutes:seconds``,
    ``hours:minutes:seconds``, ``days-hours``, ``days-hours:minutes``, ``days-hours:minutes:seconds``;
    every field after the first within its clock range, and more than nothing."""
    where = f"cluster.time={brief(text)}"
    if text.strip().upper() in ("UNLIMITED", "INFINITE"):
        return
    match = _SLURM_TIME.fullmatch(text.strip())
    _require(
        match is not None,
        f"{where} is not a Slurm time limit; use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS "
        "(e.g. 24:00:00)",
    )
    days, *clock = match.groups()
    fields = [int(f) for f in clock if f is not None]
    # D-HH[:MM[:SS]]; or MM, MM:SS, HH:MM:SS, whose first field is free
    limits = (24, 60, 60) if days is not None else {1: (), 2: (None, 60), 3: (None, 60, 60)}[len(fields)]
    for value, limit in zip(fields, limits, strict=False):
        _require(limit is None or value < limit, f"{where}: {value} is not below {limit} in its place")
    _require(any(fields) or bool(days and int(days)), f"{where} is no time at all")


def check_values(config: RecipeConfig) -> None:
    """Each field on its own: finite floats, choices, ranges, the run name. `load_recipe` runs
    these on every recipe it loads, so no later computation divides by
    a zero size or carries a NaN."""
    _check_finite(config)
    _check_choices(config)
    _check_ranges(config)
    _check_run_name(config.run.name)
    check_slurm_time(config.cluster.time)
    config.data.source  # noqa: B018 -- `data.task` read here once: a bad one named before anything runs


def _check_model(config: RecipeConfig) -> None:
    m = config.model
    _require(
        m.num_experts == 0 or 1 <= m.moe_router_topk <= m.num_experts,
        f"model.moe_router_topk={m.moe_router_topk} must be in [1, model.num_experts={m.num_experts}]",
    )
    _require(
        m.first_k_dense_layers < m.num_layers or m.num_experts == 0,
        f"model.first_k_dense_layers={m.first_k_dense_layers} leaves no MoE layer "
        f"(model.num_layers={m.num_layers})",
    )
    if m.attention == Attention.GQA:
        _require(
            m.num_attention_heads % m.num_key_value_heads == 0,
            f"model.num_attention_heads={m.num_attention_heads} must be divisible by "
            f"model.num_key_value_heads={m.num_key_value_heads}",
        )
    if (m.moe_router_num_groups is None) != (m.moe_router_group_topk is None):
        raise ConfigError(
            "model.moe_router_num_groups and model.moe_router_group_topk are set together "
            f"(got {m.moe_router_num_groups} and {m.moe_router_group_topk})"
        )
    if m.moe_router_num_groups:
        _require(
            m.num_experts % m.moe_router_num_groups == 0,
            f"model.num_experts={m.num_experts} must be divisible by "
            f"model.moe_router_num_groups={m.moe_router_num_groups}",
        )
    _require(
        m.eos_token_id is None or 0 <= m.eos_token_id < m.vocab_size,
        f"model.eos_token_id={m.eos_token_id} must be null or a token id in "
        f"[0, model.vocab_size={m.vocab_size})",
    )
    check_rope_scaling(m)


def check_rope_scaling(m: ModelConfig) -> None:
    """The rotary scaling fields of a model section; also run by the model builder.

    YaRN is accepted only where transformers (the reference the HF logits tests compare with),
    vLLM and Megatron-core compute the same cos/sin scale. With m(a) = 0.1 a ln(s) + 1, vLLM and
    Megatron always use m(mscale) / m(mscale_all_dim); transformers uses that ratio only when both
    are non-zero and m(1) otherwise. They agree when both are non-zero, or when mscale=1 and
    mscale_all_dim=0.
    """
    if m.rope_scaling_type == RopeScaling.NONE:
        return
    _require(
        m.rope_scaling_type == RopeScaling.YARN,
        f"model.rope_scaling_type='{m.rope_scaling_type}' is not one of: none, yarn",
    )
    _require(
        m.attention == Attention.MLA,
        f"model.rope_scaling_type=yarn needs model.attention=mla (got '{m.attention}'): the trainer applies "
        "YaRN in multi-latent attention only (DeepSeek-V3, Kimi-K2); use model.rope_scaling_type=none",
    )
    _require(m.rope_scaling_factor > 0, f"model.rope_scaling_factor={m.rope_scaling_factor} must be > 0")
    original = m.rope_original_max_position_embeddings
    _require(
        original is not None and original > 0,
        f"model.rope_original_max_position_embeddings={original} must be set (> 0) with "
        "model.rope_scaling_type=yarn",
    )
    _require(m.rope_beta_fast > 0, f"model.rope_beta_fast={m.rope_beta_fast} must be > 0")
    _require(m.rope_beta_slow > 0, f"model.rope_beta_slow={m.rope_beta_slow} must be > 0")
    _require(
        m.rope_mscale != 0 and (m.rope_mscale_all_dim != 0 or m.rope_mscale == 1),
        f"model.rope_mscale={m.rope_mscale} with model.rope_mscale_all_dim={m.rope_mscale_all_dim}: "
        "transformers and vLLM scale the rotary cos/sin differently here; valid: both non-zero, "
        "or rope_mscale=1 with rope_mscale_all_dim=0",
    )


def _check_batches(config: RecipeConfig) -> None:
    r = config.rollout
    _require(
        r.batch_size % r.group_size == 0,
        f"rollout.batch_size={r.batch_size} must be divisible by rollout.group_size={r.group_size}",
    )
    _require(
        r.group_size >= 2 or config.algo.advantage not in GROUP_ADVANTAGES,
        f"rollout.group_size={r.group_size}: algo.advantage={config.algo.advantage} compares each response "
        "with the others of its group, so a group of one has advantage 0 and trains nothing; use "
        "rollout.group_size >= 2, or algo.advantage=gae or reinforce_pp",
    )
    sft = config.sft.demonstrations
    _require(
        sft is None or (config.run.mode == RunMode.OFFLINE and config.data.trajectories is None),
        f"sft.demonstrations={sft}: demonstrations are what `moe-rl sft RECIPE` trains on (it sets the "
        f"offline run they need); run.mode={config.run.mode} with data.trajectories={config.data.trajectories} "
        "would not read them",
    )
    _require(
        not config.algo.dynamic_sampling or config.run.mode != RunMode.OFFLINE,
        "algo.dynamic_sampling=true with run.mode=offline: an offline run trains on stored batches and "
        "generates none to refill them; turn dynamic sampling off",
    )
    longest, response = longest_sequence(config), response_limit_key(config)
    _require(
        longest <= config.model.max_position_embeddings,
        f"data.max_prompt_len + {response} = {longest} exceeds "
        f"model.max_position_embeddings={config.model.max_position_embeddings}",
    )


def _check_algo(config: RecipeConfig) -> None:
    a, c = config.algo, config.algo.corrections
    _require(
        0 <= c.icepop.low < c.icepop.high,
        f"algo.corrections.icepop: need 0 <= low < high (got {c.icepop.low}, {c.icepop.high})",
    )
    _require(
        c.rejection.low < c.rejection.high,
        f"algo.corrections.rejection: need low < high (got {c.rejection.low}, {c.rejection.high})",
    )
    if a.routing_replay != ReplayMode.OFF:
        _require(
            config.model.num_experts > 0,
            f"algo.routing_replay={a.routing_replay} needs an MoE model (model.num_experts=0)",
        )
    if a.routing_replay == ReplayMode.R3:
        _require(
            config.rollout.return_routing,
            "algo.routing_replay=r3 replays the engine's routing: set rollout.return_routing=true",
        )
    if c.keep_sampling_mask:
        _require(
            config.rollout.return_sampling_mask,
            "algo.corrections.keep_sampling_mask=true needs rollout.return_sampling_mask=true",
        )
    _require(
        a.aggregation != Aggregation.SEQ_MEAN_GROUP_MEAN or a.objective == Objective.ESPO,
        f"algo.aggregation=seq_mean_group_mean is ESPO's own (entropy groups); algo.objective={a.objective} "
        "takes token_mean, seq_mean_token_sum, seq_mean_token_mean or seq_mean_token_sum_norm",
    )
    _require(
        (a.objective in OFFLINE_OBJECTIVES) == (config.run.mode == RunMode.OFFLINE),
        f"algo.objective={a.objective} with run.mode={config.run.mode}: DGO and SFT are the offline "
        "objectives (run.mode=offline) and offline runs train one of them",
    )
    _check_token_advantages(config)
    _require(
        (a.distill.coef > 0) == (config.teacher.path is not None),
        f"algo.distill.coef={a.distill.coef} with teacher.path={brief(config.teacher.path)}: distillation needs "
        "a teacher and a teacher is read only for distillation; set both or neither",
    )
    _require(
        a.distill.coef == 0 or config.run.mode != RunMode.OFFLINE,
        "algo.distill.coef > 0 with run.mode=offline: on-policy distillation scores the student's own samples",
    )
    if config.run.mode == RunMode.OFFLINE:
        _require(
            a.routing_replay != ReplayMode.R3 and not c.keep_sampling_mask,
            "run.mode=offline trains on stored trajectories: use algo.routing_replay=off|r2 and "
            "algo.corrections.keep_sampling_mask=false",
        )


def _check_token_advantages(config: RecipeConfig) -> None:
    """The token-level estimators (`TOKEN_ADVANTAGES`), the critic and the KL in the reward."""
    a, critic = config.algo, config.critic
    token = a.advantage in TOKEN_ADVANTAGES
    _require(
        not a.kl.in_reward or (token and a.kl.coef > 0),
        f"algo.kl.in_reward=true with algo.advantage={a.advantage} and algo.kl.coef={a.kl.coef}: the KL enters "
        "the token rewards of gae, reinforce_pp or reinforce_pp_baseline, with a coefficient > 0",
    )
    _require(
        not a.kl.in_reward or a.kl.estimator != KLEstimator.K3_IS,
        "algo.kl.in_reward=true with algo.kl.estimator=k3_is: k3_is weighs by π_θ/π_old, which is 1 at the "
        "π_old pass where the rewards are made; use k1, k2, k3 or abs",
    )
    changed = sorted(
        f"critic.{f.name}={brief(getattr(critic, f.name))}"
        for f in dataclasses.fields(critic)
        if getattr(critic, f.name) != getattr(CriticConfig(), f.name)
    )
    _require(
        not changed or a.advantage == Advantage.GAE,
        f"{', '.join(changed)} with algo.advantage={a.advantage}: a critic trains only with algo.advantage=gae "
        "(the group estimators compare a response with its group, REINFORCE++ with the batch); set "
        "algo.advantage=gae or drop the critic: section",
    )
    if not token:
        return
    _require(
        not a.dynamic_sampling and not a.zero_variance_shaping,
        f"algo.advantage={a.advantage} with algo.dynamic_sampling={a.dynamic_sampling} and "
        f"algo.zero_variance_shaping={a.zero_variance_shaping}: both act on groups of equal rewards, which "
        "a token-level estimator does not compare; use a group estimator (grpo, dr_grpo, rloo) or turn them off",
    )
    _require(
        config.run.mode != RunMode.OFFLINE,
        f"algo.advantage={a.advantage} with run.mode=offline: the offline objective (DGO) weighs stored "
        "samples by their rewards; token-level advantages are for online runs",
    )
    if a.advantage == Advantage.GAE:
        _require(
            (critic.init == CriticInit.CHECKPOINT) == (critic.init_from is not None),
            f"critic.init={critic.init} with critic.init_from={brief(critic.init_from)}: a checkpoint is "
            "named exactly when critic.init=checkpoint",
        )


def _check_quant(config: RecipeConfig) -> None:
    q = config.quant
    _require(
        q.name == config.rollout.quant,
        f"quant.name={brief(q.name)} differs from rollout.quant={brief(config.rollout.quant)}: "
        "switch recipes with rollout.quant=NAME",
    )


def _check_schedule(config: RecipeConfig) -> None:
    t = config.trainer
    _require(
        t.min_lr <= t.lr,
        f"trainer.min_lr={t.min_lr} must be <= trainer.lr={t.lr} (the schedule decays to it)",
    )
    _require(
        config.run.mode != RunMode.ASYNC or config.run.max_staleness >= 1,
        f"run.mode=async with run.max_staleness={config.run.max_staleness}: every batch is generated one "
        "policy version behind, so each would be rejected as stale and none trained on; use "
        "run.max_staleness >= 1 or run.mode=sync",
    )
    run = config.run
    _require(
        not config.rollout.inflight_updates or run.mode == RunMode.ASYNC,
        f"rollout.inflight_updates=true with run.mode={run.mode}: weights change during a generation only "
        "when training runs beside it; use run.mode=async or rollout.inflight_updates=false",
    )
    _require(
        not config.rollout.inflight_updates or config.rollout.engine == Engine.MEGATRON,
        f"rollout.inflight_updates=true with rollout.engine={config.rollout.engine}: only the Megatron engine "
        "pauses a generation for a weight sync; use rollout.engine=megatron or rollout.inflight_updates=false",
    )
    _require(
        run.async_depth == 1 or run.mode == RunMode.ASYNC,
        f"run.async_depth={run.async_depth} with run.mode={run.mode}: only an async run generates ahead; "
        "use run.mode=async or leave run.async_depth at 1",
    )
    _require(
        run.mode != RunMode.ASYNC or run.max_staleness == 0 or run.async_depth <= run.max_staleness,
        f"run.async_depth={run.async_depth} > run.max_staleness={run.max_staleness}: every batch is generated "
        f"{run.async_depth} policy versions behind and would be rejected as stale; use run.max_staleness >= "
        f"{run.async_depth} or a smaller run.async_depth",
    )


def prompt_template_fields(template: str) -> tuple[str, ...]:
    """The record fields a `data.prompt_template` names, in order (``{question}`` and
    ``{question!r:>10}`` name ``question``); a template that does not parse, uses a positional
    field (``{}``, ``{0}``), an attribute or an index, or names no field is a `ConfigError`."""
    where = f"data.prompt_template={brief(template)}"
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        raise ConfigError(
            f"{where} is not a format string: {exc} (write `{{{{` and `}}}}` for literal braces)"
        ) from None
    for name in names:
        _require(
            name.isidentifier(),
            f"{where}: `{{{name}}}` is not a field name; name a record field, e.g. {{question}} "
            "(write `{{` and `}}` for literal braces)",
        )
    _require(bool(names), f'{where} names no record field; e.g. "Solve: {{question}}"')
    return tuple(dict.fromkeys(names))


def _check_data(config: RecipeConfig) -> None:
    """The prompt-format keys: for dataset files only, chat keys only with a chat template, a
    template that names record fields. What needs the file or the tokenizer (a field missing from a
    record, a tokenizer without a chat template) is checked where they are read,
    `moe_rl.rewards.datasets`, before the run starts anything heavy."""
    d = config.data
    formatting = {
        "data.prompt_template": d.prompt_template is not None,
        "data.chat_template": d.chat_template,
        "data.system_prompt": d.system_prompt is not None,
        "data.chat_template_kwargs": bool(d.chat_template_kwargs),
    }
    if not d.source.is_file:
        for key, used in formatting.items():
            _require(
                not used,
                f"{key} formats the prompts of a dataset file (data.task=file:<path>); "
                f"data.task={d.task} makes token-id prompts",
            )
    for key in ("data.system_prompt", "data.chat_template_kwargs"):
        _require(
            d.chat_template or not formatting[key],
            f"{key} is used by the chat template: set data.chat_template=true (or remove {key})",
        )
    if d.prompt_template is not None:
        prompt_template_fields(d.prompt_template)


def _check_env(config: RecipeConfig) -> None:
    """An environment gives the rewards and generates online: `data.reward` is not used, and
    `run.mode=offline` trains on stored trajectories without one. Whether `env.name` loads, and its
    `env.kwargs`, is checked where it is built (`moe_rl.envs.base.build_env_factory`)."""
    env, d = config.env, config.data
    if not env.name:
        _require(
            not env.kwargs, f"env.kwargs={env.kwargs} without env.name: set env.name or remove env.kwargs"
        )
        return
    check_text("env.name", env.name)
    _require(
        d.reward == "synthetic",
        f"data.reward={d.reward} with env.name={env.name}: the environment gives the rewards "
        "(leave data.reward unset)",
    )
    _require(config.run.mode != RunMode.OFFLINE or config.sft.demonstrations is not None,
             f"run.mode=offline trains on stored trajectories: env.name={env.name} generates online "
             "(remove env.name; `moe-rl sft` trains on an environment's demonstrations)")  # fmt: skip


def _check_lora(config: RecipeConfig) -> None:
    lora = config.lora

    def shown(value):  # as a recipe writes it: a mode by its name
        return [str(v) for v in value] if isinstance(value, list) else str(value)

    changed = sorted(
        f"lora.{f.name}={shown(getattr(lora, f.name))}"
        for f in dataclasses.fields(lora)
        if f.name != "rank" and getattr(lora, f.name) != getattr(LoraConfig(), f.name)
    )
    _require(
        lora.rank > 0 or not changed,
        f"{', '.join(changed)} with lora.rank=0: adapters exist only with lora.rank > 0 (the full weights "
        "train otherwise); set lora.rank or drop the lora: section",
    )
    _require(
        lora.rank == 0 or bool(lora.targets),
        f"lora.rank={lora.rank} with lora.targets=[]: name the linears that carry adapters "
        f"({', '.join(LoraTarget)})",
    )
    _require(
        lora.rank == 0 or len(set(lora.targets)) == len(lora.targets),
        f"lora.targets={brief([str(t) for t in lora.targets])} names a target twice",
    )


_CHECKS: tuple[tuple[str, Callable[[RecipeConfig], None]], ...] = (
    ("values", check_values),
    ("model", _check_model),
    ("batches", _check_batches),
    ("schedule", _check_schedule),
    ("algorithm", _check_algo),
    ("quantization recipe", _check_quant),
    ("LoRA", _check_lora),
    ("data", _check_data),
    ("environment", _check_env),
)


def recipe_rules(config: RecipeConfig) -> list[Rule]:
    """The recipe's own consistency as rules, one per area (field values, model, batches, schedule,
    algorithm, quantization recipe, data, environment). The areas run in order and stop at the
    first that fails: the later ones assume the earlier hold. A rule's detail is the error line."""
    rules = []
    for name, check in _CHECKS:
        try:
            check(config)
        except ConfigError as exc:
            return [*rules, Rule(f"recipe {name}", False, str(exc))]
        rules.append(Rule(f"recipe {name}", True, "consistent"))
    return rules
