"""Recipe names → `moe_rl.algo` functions with their hyper-parameters bound.

The one place config meets math. It takes plain dicts / keyword arguments (never config
objects) and imports no torch at module level, so the config validator can import the name
tuples cheaply; the math modules are imported when something is bound.

Names (``algo.*`` in recipes):

* ``objective`` ∈ `OBJECTIVES`, hyper-parameters in `OBJECTIVE_PARAMS`;
* ``advantage`` ∈ `ADVANTAGES`; ``aggregation`` ∈ `AGGREGATIONS`; ``kl.estimator`` ∈ `KL_ESTIMATORS`
  (``kl.coef`` and the aggregation bound with it by `bind_kl_loss`);
* ``corrections``: ``tis.mode`` ∈ `TIS_MODES` (``tis.cap``), ``icepop.{enabled, low, high}``,
  ``rejection.{enabled, divergence ∈ REJECTION_DIVERGENCES, aggregation ∈
  REJECTION_AGGREGATIONS, low, high}``, ``opsm.{enabled, delta}``, ``mode`` ∈ `CORRECTION_MODES`.
  Nested dicts are flattened to ``tis_mode``, ``icepop_low``, … (`CORRECTION_PARAMS`).

Bound callables take tensors by keyword. Every objective is called the same way —
``objective(logp=, old_logp=, advantages=, loss_mask=, seq_ids=, num_seqs=, **extra)`` —
and keywords the function does not take (e.g. ``entropy`` for PPO) are dropped, so a trainer
can pass one batch dict to any objective. Missing required inputs raise ValueError.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from moe_rl.algo.modes import (
    AGGREGATIONS,
    OWN_AGGREGATIONS,
    Advantage,
    Aggregation,
    Divergence,
    KLEstimator,
    Objective,
    PolicyMode,
    RejectionAggregation,
    TISMode,
    values,
)

OBJECTIVES = values(Objective)
ADVANTAGES = values(Advantage)
KL_ESTIMATORS = values(KLEstimator)
TIS_MODES = values(TISMode)
REJECTION_DIVERGENCES = values(Divergence)
REJECTION_AGGREGATIONS = values(RejectionAggregation)
CORRECTION_MODES = values(PolicyMode)

OBJECTIVE_PARAMS: dict[str, dict[str, Any]] = {
    "ppo_clip": {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip_c": 3.0},
    "gspo": {"gspo_eps_low": 3e-4, "gspo_eps_high": 4e-4},
    "gspo_token": {"gspo_eps_low": 3e-4, "gspo_eps_high": 4e-4},
    "cispo": {"clip_eps_low": 0.2, "clip_eps_high": 0.2},
    "reinforce": {},
    "espo": {"espo_rho": 0.2, "espo_num_groups": 2, "espo_alpha": 0.02},
    "dgo": {"dgo_beta": 0.1},
}
"""Hyper-parameters each objective takes, with the defaults of `moe_rl.algo.objectives`."""

DEFAULT_AGGREGATION = {
    "ppo_clip": "token_mean",
    "gspo": "seq_mean_token_mean",
    "gspo_token": "seq_mean_token_mean",
    "cispo": "token_mean",
    "reinforce": "token_mean",
    "espo": "seq_mean_group_mean",
    "dgo": "seq_mean_token_sum",
}
"""The papers' aggregations; ``seq_mean_group_mean`` is ESPO's own (not in `AGGREGATIONS`)."""


ADVANTAGE_PARAMS: dict[str, dict[str, Any]] = {"grpo": {"eps": 1e-6}, "dr_grpo": {}, "rloo": {}}

CORRECTION_PARAMS: dict[str, Any] = {
    "mode": "decoupled",
    "tis_mode": "off",
    "tis_cap": 2.0,
    "icepop_enabled": False,
    "icepop_low": 0.5,
    "icepop_high": 5.0,
    "rejection_enabled": False,
    "rejection_divergence": "k1",
    "rejection_aggregation": "seq_mean",
    "rejection_low": None,
    "rejection_high": None,
    "opsm_enabled": False,
    "opsm_delta": None,
}
"""Flat correction keys and defaults (rejection band None = 0.999..1.001 for k1)."""

_OBJECTIVE_FUNCS = {name: ("moe_rl.algo.objectives", name) for name in OBJECTIVES}
_ADVANTAGE_FUNCS = {name: ("moe_rl.algo.advantages", name) for name in ADVANTAGES}


def _choice(field: str, value: Any, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise ValueError(f"{field} must be one of {valid}, got {value!r}")
    return value


def _load(module: str, attr: str) -> Callable:
    return getattr(importlib.import_module(module), attr)


def _merge(params: Mapping[str, Any] | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(
            f"pass hyper-parameters as a plain dict or keywords, not {type(params).__name__} "
            "(e.g. dataclasses.asdict(cfg) or OmegaConf.to_container(cfg))"
        )
    merged = dict(params or {})
    merged.update(kwargs)
    return merged


def _filter_call(func: Callable, bound: Mapping[str, Any], what: str) -> Callable[..., Any]:
    """Call `func` with `bound` plus the caller's keywords it accepts; error on missing ones."""
    sig = inspect.signature(func)
    accepted = set(sig.parameters)
    required = {n for n, p in sig.parameters.items() if p.default is inspect.Parameter.empty}

    def call(**tensors: Any) -> Any:
        args = {k: v for k, v in tensors.items() if k in accepted}
        args.update(bound)
        missing = sorted(required - set(args))
        if missing:
            raise ValueError(f"{what} needs inputs {missing}; got {sorted(tensors)}")
        return func(**args)

    call.__name__ = func.__name__
    call.__doc__ = func.__doc__
    return call


def objective_params(name: str, params: Mapping[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """The hyper-parameters objective `name` uses, defaults filled in, from a flat dict.

    Keys that belong to another objective are ignored (a recipe may carry all of them); keys
    no objective knows raise ValueError.
    """
    _choice("algo.objective", name, OBJECTIVES)
    merged = _merge(params, kwargs)
    known = {k for spec in OBJECTIVE_PARAMS.values() for k in spec}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ValueError(f"unknown objective hyper-parameters {unknown}; valid: {sorted(known)}")
    spec = OBJECTIVE_PARAMS[name]
    return {k: merged.get(k, default) for k, default in spec.items()}


def bind_objective(
    name: str,
    params: Mapping[str, Any] | None = None,
    *,
    aggregation: str | None = None,
    norm_len: float | None = None,
    **kwargs: Any,
) -> Callable[..., Any]:
    """Objective `name` with its hyper-parameters and aggregation bound; returns ``f(**tensors) -> LossOutput``.

    `aggregation` None = the paper's (`DEFAULT_AGGREGATION`); otherwise one of `AGGREGATIONS` or
    the objective's own (`OWN_AGGREGATIONS`). `norm_len` is the constant L of
    ``seq_mean_token_sum_norm`` (the trainer binds the most tokens a trajectory samples,
    `moe_rl.config.derived.max_sampled_tokens`: ``rollout.max_new_tokens`` for one turn).
    """
    hparams = objective_params(name, params, **kwargs)
    if aggregation is None:
        aggregation = DEFAULT_AGGREGATION[name]
    else:
        _choice("algo.aggregation", aggregation, AGGREGATIONS + OWN_AGGREGATIONS.get(name, ()))
    hparams["aggregation"] = aggregation
    if norm_len is not None:
        hparams["norm_len"] = norm_len
    return _filter_call(_load(*_OBJECTIVE_FUNCS[name]), hparams, f"objective {name!r}")


def bind_advantage(name: str, params: Mapping[str, Any] | None = None, **kwargs: Any) -> Callable[..., Any]:
    """Advantage estimator `name`: ``f(rewards=[S], group_ids=[S]) -> [S]``."""
    _choice("algo.advantage", name, ADVANTAGES)
    merged = _merge(params, kwargs)
    unknown = sorted(set(merged) - set(ADVANTAGE_PARAMS[name]))
    if unknown:
        raise ValueError(
            f"unknown hyper-parameters {unknown} for advantage {name!r}; valid: {sorted(ADVANTAGE_PARAMS[name])}"
        )
    return _filter_call(_load(*_ADVANTAGE_FUNCS[name]), merged, f"advantage {name!r}")


def bind_aggregation(name: str, **kwargs: Any) -> Callable[..., Any]:
    """Aggregation `name`: ``f(token_loss=, loss_mask=, seq_ids=, num_seqs=, ...) -> (sum, denom)``."""
    _choice("algo.aggregation", name, AGGREGATIONS)
    return _filter_call(
        _load("moe_rl.algo.aggregate", "aggregate"), {"mode": name, **kwargs}, f"aggregation {name!r}"
    )


def bind_kl(estimator: str) -> Callable[..., Any]:
    """KL estimator: ``f(logp=, ref_logp=, old_logp=None) -> [T]`` per-token values."""
    _choice("algo.kl.estimator", estimator, KL_ESTIMATORS)
    return _filter_call(_load("moe_rl.algo.kl", "kl_penalty"), {"estimator": estimator}, f"kl {estimator!r}")


KL_AGGREGATION = {Aggregation.SEQ_MEAN_GROUP_MEAN: Aggregation.SEQ_MEAN_TOKEN_MEAN}
"""The KL term's aggregation under an objective's own one: ESPO's groups belong to its clip, so its
KL term is the mean over responses of each response's token mean (the same denominator, the count
of responses)."""

TRAINED_AS = {Objective.DGO: Objective.REINFORCE}
"""Objectives trained as another: DGO's loss −w_i·log π(y_i|x) is REINFORCE with A_i = w_i (the
driver computes the weights over the whole batch, as a prompt's samples may span micro-batches,
and passes them as advantages)."""


def recipe_objective_params(algo: Mapping[str, Any]) -> dict[str, Any]:
    """The objectives' hyper-parameters a recipe's ``algo`` section sets, as the functions take
    them: the recipe's ``dual_clip_c <= 1`` (dual clip off) is None."""
    names = {k for spec in OBJECTIVE_PARAMS.values() for k in spec}
    params = {k: algo[k] for k in names if k in algo}
    if params.get("dual_clip_c") is not None and params["dual_clip_c"] <= 1:
        params["dual_clip_c"] = None
    return params


def bind_recipe_objective(
    objective: str, algo: Mapping[str, Any], aggregation: str, norm_len: float | None = None
) -> Callable[..., Any]:
    """The loss a trainer trains a recipe's objective with: `TRAINED_AS` resolved, the recipe's
    hyper-parameters (`recipe_objective_params`) and aggregation bound (`bind_objective`)."""
    trained = TRAINED_AS.get(objective, objective)
    return bind_objective(trained, recipe_objective_params(algo), aggregation=aggregation, norm_len=norm_len)


def denominator_aggregation(aggregation: str) -> str:
    """The aggregation whose count divides a recipe's loss: its own, or for an objective's own
    aggregation (ESPO's groups) the count of responses, as its KL term (`KL_AGGREGATION`)."""
    return KL_AGGREGATION.get(aggregation, aggregation)


def bind_kl_loss(
    estimator: str, coef: float, aggregation: str, norm_len: float | None = None
) -> Callable[..., Any]:
    """The KL penalty as a loss (`moe_rl.algo.kl.kl_loss`) with its estimator, coefficient and the
    recipe's aggregation bound (`KL_AGGREGATION` for an objective's own):
    ``f(logp=, ref_logp=, loss_mask=, seq_ids=, num_seqs=, old_logp=None) -> LossOutput``."""
    _choice("algo.kl.estimator", estimator, KL_ESTIMATORS)
    mode = _choice("algo.aggregation", KL_AGGREGATION.get(aggregation, aggregation), AGGREGATIONS)
    if not isinstance(coef, int | float) or not coef > 0:
        raise ValueError(f"algo.kl.coef must be > 0 for a KL loss, got {coef!r}")
    bound = {"estimator": estimator, "coef": float(coef), "aggregation": mode}
    if norm_len is not None:
        bound["norm_len"] = norm_len
    return _filter_call(_load("moe_rl.algo.kl", "kl_loss"), bound, f"kl loss {estimator!r}")


def flatten_corrections(params: Mapping[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """``{"tis": {"mode": "token"}}`` → ``{"tis_mode": "token"}``; defaults filled; unknown keys error."""
    flat: dict[str, Any] = {}
    for key, value in _merge(params, kwargs).items():
        if isinstance(value, Mapping):
            flat.update({f"{key}_{sub}": v for sub, v in value.items()})
        else:
            flat[key] = value
    unknown = sorted(set(flat) - set(CORRECTION_PARAMS))
    if unknown:
        raise ValueError(f"unknown correction keys {unknown}; valid: {sorted(CORRECTION_PARAMS)}")
    spec = {**CORRECTION_PARAMS, **flat}
    _choice("algo.corrections.mode", spec["mode"], CORRECTION_MODES)
    _choice("algo.corrections.tis.mode", spec["tis_mode"], TIS_MODES)
    _choice("algo.corrections.rejection.divergence", spec["rejection_divergence"], REJECTION_DIVERGENCES)
    _choice("algo.corrections.rejection.aggregation", spec["rejection_aggregation"], REJECTION_AGGREGATIONS)
    if spec["opsm_enabled"] and spec["opsm_delta"] is None:
        raise ValueError(
            "algo.corrections.opsm.delta must be set when opsm is enabled (no published default)"
        )
    return spec


@dataclass(frozen=True)
class CorrectionStack:
    """The enabled corrections of a recipe, applied in one call (see `bind_corrections`)."""

    spec: Mapping[str, Any]

    def old_logp(self, old_logp: Any, rollout_logp: Any) -> Any:
        """π_old log-probs for the objective: `rollout_logp` in bypass mode."""
        resolve = _load("moe_rl.algo.corrections", "resolve_old_logp")
        return resolve(old_logp, rollout_logp, mode=self.spec["mode"])

    def __call__(
        self,
        *,
        logp: Any,
        old_logp: Any,
        rollout_logp: Any,
        advantages: Any,
        loss_mask: Any,
        seq_ids: Any,
        num_seqs: int,
    ) -> Any:
        """Return the combined `CorrectionOutput` (weights product, mask AND, metrics)."""
        c = importlib.import_module("moe_rl.algo.corrections")
        s = self.spec
        old_logp = self.old_logp(old_logp, rollout_logp)
        outs = []
        if s["tis_mode"] == "token":
            outs.append(c.token_tis(old_logp, rollout_logp, loss_mask, cap=s["tis_cap"]))
        elif s["tis_mode"] == "seq":
            outs.append(
                c.seq_tis(old_logp, rollout_logp, loss_mask, seq_ids, num_seqs=num_seqs, cap=s["tis_cap"])
            )
        if s["icepop_enabled"]:
            outs.append(
                c.icepop(old_logp, rollout_logp, loss_mask, low=s["icepop_low"], high=s["icepop_high"])
            )
        if s["rejection_enabled"]:
            outs.append(
                c.rejection_mask(
                    old_logp, rollout_logp, loss_mask, seq_ids, num_seqs=num_seqs,
                    divergence=s["rejection_divergence"], aggregation=s["rejection_aggregation"],
                    low=s["rejection_low"], high=s["rejection_high"],
                )
            )  # fmt: skip
        if s["opsm_enabled"]:
            outs.append(
                c.opsm_mask(
                    logp,
                    rollout_logp,
                    advantages,
                    loss_mask,
                    seq_ids,
                    num_seqs=num_seqs,
                    delta=s["opsm_delta"],
                )
            )
        return c.combine(loss_mask, *outs)


def bind_corrections(params: Mapping[str, Any] | None = None, **kwargs: Any) -> CorrectionStack:
    """A `CorrectionStack` from the recipe's corrections section (nested or flat dict)."""
    return CorrectionStack(flatten_corrections(params, **kwargs))
