"""Recipe choices → `moe_rl.algo` functions with the recipe's values bound.

The one place config meets math. It takes the recipe's typed modes (`moe_rl.algo.modes` members,
as the recipe loader makes them; a plain string is refused) and a section's values as a plain
dict (``dataclasses.asdict`` of it, never a config object), and imports no torch at module level:
the math modules are imported when something is bound.

Every value comes from the caller: the recipe schema is the one home of the defaults (the
functions' keyword defaults serve their direct callers only). What each function gets is declared
here: the recipe values it binds (`OBJECTIVE_PARAMS`; a correction section's fields but its
switch) and the inputs it reads (`OBJECTIVE_INPUTS`, `CORRECTION_FUNCS`, `KL_INPUTS`). `bind`
checks that declaration against the function's signature when the recipe is resolved, at start:
a keyword the function does not take, or one it needs that nothing passes, is an error then,
never a keyword dropped at a call.

* ``algo.objective`` with its hyper-parameters and ``algo.aggregation``: `bind_objective`, and for
  the trainer `bind_recipe_objective` (`TRAINED_AS`; a dual-clip floor <= 1 is off);
* ``algo.advantage``: `bind_advantage` (the driver's per-response part, `DRIVER_FUNCS`; with DGO's
  sample weights, or SFT's, in its place for that objective, `bind_step_advantage`) and, for the
  token-level estimators, `bind_token_advantage` (the trainer's part, `TOKEN_FUNCS`, with ``algo.gae``
  and ``algo.kl.in_reward``); ``algo.kl``: `bind_kl_loss` (`KL_AGGREGATION`); the critic's loss:
  `bind_value_loss`;
* ``algo.corrections`` and ``algo.policy_mode``: `bind_corrections`, a `CorrectionStack`.

Objectives are called alike, with the keywords of `OBJECTIVE_CALL` (``logp=, old_logp=,
advantages=, loss_mask=, seq_ids=, num_seqs=, weights=, entropy=, vocab_size=``, and DGO's
``rewards=, group_ids=``), so a trainer calls any of them one way; each passes its function the
inputs `OBJECTIVE_INPUTS` names (``entropy`` is ESPO's alone). A keyword outside the call is a
TypeError, an input the function needs and the call lacks a ValueError.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any, TypeVar

from moe_rl.algo.modes import (
    OWN_AGGREGATIONS,
    SHARED_AGGREGATIONS,
    TOKEN_ADVANTAGES,
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

Mode = TypeVar("Mode", bound=StrEnum)

OBJECTIVE_PARAMS: dict[Objective, tuple[str, ...]] = {
    Objective.PPO_CLIP: ("clip_eps_low", "clip_eps_high", "dual_clip_c"),
    Objective.GSPO: ("gspo_eps_low", "gspo_eps_high"),
    Objective.GSPO_TOKEN: ("gspo_eps_low", "gspo_eps_high"),
    Objective.CISPO: ("clip_eps_low", "clip_eps_high"),
    Objective.REINFORCE: (),
    Objective.ESPO: ("espo_rho", "espo_num_groups", "espo_alpha"),
    Objective.DGO: ("dgo_beta",),
    Objective.SFT: (),
}
"""The recipe's ``algo.*`` hyper-parameters each objective binds (the functions' keywords of the
same names); their values, defaults included, come from the recipe."""

_TOKENS = ("logp", "loss_mask", "seq_ids", "num_seqs")
_POLICY = (*_TOKENS, "old_logp", "advantages", "weights")
OBJECTIVE_INPUTS: dict[Objective, tuple[str, ...]] = {
    Objective.PPO_CLIP: _POLICY,
    Objective.GSPO: _POLICY,
    Objective.GSPO_TOKEN: _POLICY,
    Objective.CISPO: _POLICY,
    Objective.REINFORCE: (*_TOKENS, "advantages", "weights"),
    Objective.ESPO: (*_POLICY, "entropy", "vocab_size"),
    Objective.DGO: (*_TOKENS, "rewards", "group_ids"),
    Objective.SFT: _TOKENS,
}
"""The inputs each objective's function reads from a call (`OBJECTIVE_CALL`)."""

OBJECTIVE_CALL: tuple[str, ...] = tuple(dict.fromkeys(k for ks in OBJECTIVE_INPUTS.values() for k in ks))
"""The keywords any bound objective is called with."""

KL_INPUTS = (*_TOKENS, "ref_logp", "old_logp")
"""The inputs of the KL penalty as a loss (`moe_rl.algo.kl.kl_loss`)."""

_RATIO = ("old_logp", "rollout_logp", "loss_mask")
_SEQS = ("seq_ids", "num_seqs")
TIS_FUNCS: dict[TISMode, tuple[str, tuple[str, ...]]] = {
    TISMode.TOKEN: ("token_tis", _RATIO),
    TISMode.SEQ: ("seq_tis", (*_RATIO, *_SEQS)),
}
"""``algo.corrections.tis.mode`` → the function (`moe_rl.algo.corrections`) and the inputs it reads;
``off`` binds none. The section's other fields (``cap``) are bound by name."""

CORRECTION_FUNCS: dict[str, tuple[str, tuple[str, ...]]] = {
    "icepop": ("icepop", _RATIO),
    "rejection": ("rejection_mask", (*_RATIO, *_SEQS)),
    "opsm": ("opsm_mask", ("logp", "rollout_logp", "advantages", "loss_mask", *_SEQS)),
}
"""The switched correction sections (``algo.corrections.<section>.enabled``) in the order they
apply, each → its function and the inputs it reads; the section's other fields are bound by name."""

SECTION_MODES: dict[str, dict[str, type[StrEnum]]] = {
    "rejection": {"divergence": Divergence, "aggregation": RejectionAggregation},
}
"""The bound correction fields that are typed modes (checked to be members when bound; TIS's mode
is checked where it picks the function)."""

CORRECTION_CALL = ("logp", "old_logp", "rollout_logp", "advantages", "loss_mask", *_SEQS)
"""The inputs `CorrectionStack` hands each correction (each reads those its entry names)."""

KL_AGGREGATION = {Aggregation.SEQ_MEAN_GROUP_MEAN: Aggregation.SEQ_MEAN_TOKEN_MEAN}
"""The KL term's aggregation under an objective's own one: ESPO's groups belong to its clip, so its
KL term is the mean over responses of each response's token mean (the same denominator, the count
of responses)."""

TRAINED_AS = {Objective.DGO: Objective.REINFORCE, Objective.SFT: Objective.REINFORCE}
"""Objectives trained as another: DGO's loss −w_i·log π(y_i|x) is REINFORCE with A_i = w_i (the
driver computes the weights over the whole batch, as a prompt's samples may span micro-batches,
and passes them as advantages); SFT's is the same with every w_i = 1."""


def _member(field: str, value: Any, mode: type[Mode]) -> Mode:
    """`value` if it is a member of `mode`; a string or anything else is refused, naming `field`."""
    if not isinstance(value, mode):
        raise ValueError(
            f"{field} must be a member of {mode.__name__}, one of {values(mode)}, got {value!r} "
            f"({type(value).__name__})"
        )
    return value


def values_of(members: Iterable[StrEnum]) -> tuple[str, ...]:
    """The recipe spellings of `members`, for messages."""
    return tuple(m.value for m in members)


def _load(module: str, attr: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Bound:
    """A math function with the recipe's values bound, called with tensors by keyword (`bind`)."""

    func: Callable[..., Any]
    values: Mapping[str, Any]
    """The recipe's values, passed on every call."""
    inputs: tuple[str, ...]
    """The call's keywords the function reads."""
    call: frozenset[str]
    """The keywords a caller may pass: `inputs` and the rest of its family's common call."""
    needed: frozenset[str]
    """The inputs the function has no default for."""
    what: str

    def __call__(self, **given: Any) -> Any:
        unknown = sorted(set(given) - self.call)
        if unknown:
            raise TypeError(f"{self.what} is called with {sorted(self.call)}, not {unknown}")
        missing = sorted(self.needed - set(given))
        if missing:
            raise ValueError(f"{self.what} needs inputs {missing}; got {sorted(given)}")
        return self.func(**{k: given[k] for k in self.inputs if k in given}, **self.values)


def bind(
    func: Callable[..., Any],
    values: Mapping[str, Any],
    inputs: Iterable[str],
    what: str,
    call: Iterable[str] | None = None,
) -> Bound:
    """`func` with `values` bound, reading `inputs` from a call that may pass `call` (default:
    just `inputs`). Refused here, when the recipe is resolved: a value or input `func` does not
    take, a parameter it needs that neither names, a name both bound and read, an input outside
    the call."""
    inputs = tuple(inputs)
    params = inspect.signature(func).parameters
    passed = set(values) | set(inputs)
    target = f"{what} ({func.__module__}.{func.__qualname__})"
    lacks = sorted(passed - set(params))
    if lacks:
        raise ValueError(f"{target} does not take {lacks}; it takes {sorted(params)}")
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    unmet = sorted(required - passed)
    if unmet:
        raise ValueError(f"{target} needs {unmet}, which nothing passes")
    both = sorted(set(values) & set(inputs))
    if both:
        raise ValueError(f"{target} has {both} both bound and read from the call")
    call = frozenset(inputs if call is None else call)
    outside = sorted(set(inputs) - call)
    if outside:
        raise ValueError(f"{target} reads {outside}, which its call {sorted(call)} lacks")
    return Bound(func, MappingProxyType(dict(values)), inputs, call, frozenset(required & set(inputs)), what)


def bind_objective(
    objective: Objective,
    params: Mapping[str, Any],
    *,
    aggregation: Aggregation,
    norm_len: float | None,
) -> Bound:
    """Objective `objective` with its hyper-parameters (exactly `OBJECTIVE_PARAMS`'s), `aggregation`
    (a shared one or the objective's own, `OWN_AGGREGATIONS`) and `norm_len` bound (the constant L
    of ``seq_mean_token_sum_norm``: the trainer binds the most tokens a trajectory samples,
    `moe_rl.config.derived.max_sampled_tokens`); returns ``f(**tensors) -> LossOutput``."""
    objective = _member("algo.objective", objective, Objective)
    aggregation = _member("algo.aggregation", aggregation, Aggregation)
    allowed = SHARED_AGGREGATIONS + OWN_AGGREGATIONS.get(objective, ())
    if aggregation not in allowed:
        raise ValueError(
            f"algo.aggregation must be one of {values_of(allowed)} for algo.objective={objective}, "
            f"got {aggregation.value!r}"
        )
    if not isinstance(params, Mapping):
        raise TypeError(
            f"pass hyper-parameters as a plain dict, not {type(params).__name__} (e.g. dataclasses.asdict(cfg))"
        )
    names = OBJECTIVE_PARAMS[objective]
    if set(params) != set(names):
        raise ValueError(
            f"objective {objective.value!r} binds hyper-parameters {sorted(names)}, got {sorted(params)}"
        )
    bound = {**params, "aggregation": aggregation, "norm_len": norm_len}
    func = _load("moe_rl.algo.objectives", objective.value)
    what = f"objective {objective.value!r}"
    return bind(func, bound, OBJECTIVE_INPUTS[objective], what, call=OBJECTIVE_CALL)


def bind_recipe_objective(
    objective: Objective, algo: Mapping[str, Any], aggregation: Aggregation, norm_len: float | None
) -> Bound:
    """The loss a trainer trains a recipe's objective with: `TRAINED_AS` resolved, that objective's
    hyper-parameters taken from the recipe's ``algo`` section (`algo`, a plain dict of it; a
    ``dual_clip_c <= 1``, dual clip off, is None) and bound with `bind_objective`."""
    trained = TRAINED_AS.get(_member("algo.objective", objective, Objective), objective)
    names = OBJECTIVE_PARAMS[trained]
    missing = sorted(set(names) - set(algo))
    if missing:
        raise ValueError(f"the algo section lacks {missing}, which objective {trained.value!r} binds")
    params = {name: algo[name] for name in names}
    if params.get("dual_clip_c") is not None and params["dual_clip_c"] <= 1:
        params["dual_clip_c"] = None
    return bind_objective(trained, params, aggregation=aggregation, norm_len=norm_len)


DRIVER_FUNCS: dict[Advantage, str] = {
    Advantage.GRPO: "grpo",
    Advantage.DR_GRPO: "dr_grpo",
    Advantage.RLOO: "rloo",
    Advantage.GAE: "outcome",
    Advantage.REINFORCE_PP: "outcome",
    Advantage.REINFORCE_PP_BASELINE: "dr_grpo",
}
"""``algo.advantage`` → what the driver computes per response over the whole batch
(`moe_rl.algo.advantages`): the advantage of a group estimator, or the score a token-level one
(`TOKEN_ADVANTAGES`) places on the response's last token: its reward (GAE, REINFORCE++), its reward
less its group's mean (REINFORCE++'s group-baseline variant)."""

TOKEN_FUNCS: dict[Advantage, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    Advantage.GAE: ("gae_estimate", ("gamma", "lam"), ("values",)),
    Advantage.REINFORCE_PP: ("reinforce_pp_estimate", ("gamma",), ()),
    Advantage.REINFORCE_PP_BASELINE: ("reinforce_pp_estimate", ("gamma",), ()),
}
"""The token-level estimators → their function (`moe_rl.algo.returns`), the ``algo.gae`` fields it
binds and the inputs it reads beside the common ones (`TOKEN_CALL`)."""

TOKEN_CALL = ("scores", "seq_ids", "num_seqs", "old_logp", "ref_logp", "values")
"""The keywords a bound token-level estimator is called with (``values``: the critic's, GAE's alone)."""

VALUE_INPUTS = ("values", "old_values", "returns", "loss_mask", "seq_ids", "num_seqs")
"""The inputs of the critic's loss (`moe_rl.algo.value.value_loss`)."""


def bind_advantage(advantage: Advantage) -> Bound:
    """The driver's part of estimator `advantage` (`DRIVER_FUNCS`): ``f(rewards=[S], group_ids=[S])
    -> [S]``. The recipe sets no hyper-parameter of theirs (GRPO's ε is the function's own)."""
    advantage = _member("algo.advantage", advantage, Advantage)
    func = _load("moe_rl.algo.advantages", DRIVER_FUNCS[advantage])
    return bind(func, {}, ("rewards", "group_ids"), f"advantage {advantage.value!r}")


def bind_step_advantage(objective: Objective, advantage: Advantage, dgo_beta: float) -> Bound:
    """What the driver computes per response of a step's batch, ``f(rewards=[S], group_ids=[S]) -> [S]``:
    for ``objective`` DGO its sample weights (`moe_rl.algo.objectives.dgo_weights`, the recipe's
    ``dgo_beta`` bound), for SFT weights of 1 (`moe_rl.algo.objectives.sft_weights`), else the
    driver's part of ``advantage`` (`bind_advantage`)."""
    objective = _member("algo.objective", objective, Objective)
    if objective == Objective.DGO:
        func = _load("moe_rl.algo.objectives", "dgo_weights")
        return bind(func, {"dgo_beta": dgo_beta}, ("rewards", "group_ids"), "DGO's sample weights")
    if objective == Objective.SFT:
        func = _load("moe_rl.algo.objectives", "sft_weights")
        return bind(func, {}, ("rewards", "group_ids"), "SFT's sample weights")
    return bind_advantage(advantage)


def bind_token_advantage(
    advantage: Advantage, gae: Mapping[str, Any], kl_coef: float, kl_estimator: KLEstimator, in_reward: bool
) -> Bound | None:
    """The trainer's part of a token-level estimator (`TOKEN_FUNCS`; None for a group one):
    ``f(scores=[S], seq_ids=, num_seqs=, old_logp=, ref_logp=, values=) -> TokenReturns``, with its
    ``algo.gae`` fields (`gae`, a plain dict of the section) and, with ``algo.kl.in_reward``, the KL
    penalty's coefficient and estimator bound (without it the coefficient bound is 0: no KL in the
    reward)."""
    advantage = _member("algo.advantage", advantage, Advantage)
    if advantage not in TOKEN_ADVANTAGES:
        return None
    estimator = _member("algo.kl.estimator", kl_estimator, KLEstimator)
    name, fields, extra = TOKEN_FUNCS[advantage]
    missing = sorted(set(fields) - set(gae))
    if missing:
        raise ValueError(f"the algo.gae section lacks {missing}, which advantage {advantage.value!r} binds")
    coef = float(kl_coef) if in_reward else 0.0
    bound = {**{f: gae[f] for f in fields}, "kl_coef": coef, "kl_estimator": estimator}
    inputs = ("scores", "seq_ids", "num_seqs", "old_logp", "ref_logp", *extra)
    func = _load("moe_rl.algo.returns", name)
    return bind(func, bound, inputs, f"advantage {advantage.value!r}", call=TOKEN_CALL)


def bind_value_loss(clip: float) -> Bound:
    """The critic's clipped value loss (`moe_rl.algo.value.value_loss`) with the value clip bound
    (``critic.clip``): ``f(values=, old_values=, returns=, loss_mask=, seq_ids=, num_seqs=) ->
    LossOutput``."""
    func = _load("moe_rl.algo.value", "value_loss")
    return bind(func, {"clip": clip}, VALUE_INPUTS, "critic value loss")


def denominator_aggregation(aggregation: Aggregation) -> Aggregation:
    """The aggregation whose count divides a recipe's loss: its own, or for an objective's own
    aggregation (ESPO's groups) the count of responses, as its KL term (`KL_AGGREGATION`)."""
    aggregation = _member("algo.aggregation", aggregation, Aggregation)
    return KL_AGGREGATION.get(aggregation, aggregation)


def bind_kl_loss(
    estimator: KLEstimator, coef: float, aggregation: Aggregation, norm_len: float | None
) -> Bound:
    """The KL penalty as a loss (`moe_rl.algo.kl.kl_loss`) with its estimator, coefficient, the
    recipe's aggregation (`KL_AGGREGATION` for an objective's own) and `norm_len` bound:
    ``f(logp=, ref_logp=, loss_mask=, seq_ids=, num_seqs=, old_logp=) -> LossOutput``."""
    estimator = _member("algo.kl.estimator", estimator, KLEstimator)
    mode = denominator_aggregation(aggregation)
    if mode not in SHARED_AGGREGATIONS:
        raise ValueError(
            f"algo.aggregation must be one of {values_of(SHARED_AGGREGATIONS)}, got {mode.value!r}"
        )
    if not isinstance(coef, int | float) or not coef > 0:
        raise ValueError(f"algo.kl.coef must be > 0 for a KL loss, got {coef!r}")
    bound = {"estimator": estimator, "coef": float(coef), "aggregation": mode, "norm_len": norm_len}
    func = _load("moe_rl.algo.kl", "kl_loss")
    return bind(func, bound, KL_INPUTS, f"kl loss {estimator.value!r}")


@dataclass(frozen=True)
class CorrectionStack:
    """The recipe's corrections in one call: π_old resolved by ``algo.policy_mode``, then each
    enabled correction on the same loss mask, combined (weights product, mask AND, metrics)."""

    policy: Bound
    """`moe_rl.algo.corrections.resolve_old_logp` with the policy mode bound."""
    steps: tuple[Bound, ...]

    def old_logp(self, old_logp: Any, rollout_logp: Any) -> Any:
        """π_old log-probs for the objective: `rollout_logp` in bypass mode."""
        return self.policy(old_logp=old_logp, rollout_logp=rollout_logp)

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
        given = {
            "logp": logp, "old_logp": self.old_logp(old_logp, rollout_logp), "rollout_logp": rollout_logp,
            "advantages": advantages, "loss_mask": loss_mask, "seq_ids": seq_ids, "num_seqs": num_seqs,
        }  # fmt: skip
        combine = _load("moe_rl.algo.corrections", "combine")
        return combine(loss_mask, *(step(**given) for step in self.steps))


def _bind_correction(section: str, fields: Mapping[str, Any], name: str, inputs: tuple[str, ...]) -> Bound:
    """Correction `name` with the section's `fields` bound by name (typed ones checked as members)."""
    for field, mode in SECTION_MODES.get(section, {}).items():
        if field in fields:
            _member(f"algo.corrections.{section}.{field}", fields[field], mode)
    func = _load("moe_rl.algo.corrections", name)
    return bind(func, fields, inputs, f"algo.corrections.{section}", call=CORRECTION_CALL)


def bind_corrections(sections: Mapping[str, Mapping[str, Any]], policy_mode: PolicyMode) -> CorrectionStack:
    """A `CorrectionStack` from the recipe's ``algo.corrections`` sections (``tis`` and those of
    `CORRECTION_FUNCS`, each a plain dict of its fields) and ``algo.policy_mode``."""
    policy_mode = _member("algo.policy_mode", policy_mode, PolicyMode)
    known = ("tis", *CORRECTION_FUNCS)
    if sorted(sections) != sorted(known):
        raise ValueError(f"algo.corrections binds sections {sorted(known)}, got {sorted(sections)}")
    policy = bind(
        _load("moe_rl.algo.corrections", "resolve_old_logp"),
        {"mode": policy_mode},
        ("old_logp", "rollout_logp"),
        "algo.policy_mode",
    )
    tis = dict(sections["tis"])
    tis_mode = _member("algo.corrections.tis.mode", tis.pop("mode", None), TISMode)
    steps = []
    if tis_mode is not TISMode.OFF:
        steps.append(_bind_correction("tis", tis, *TIS_FUNCS[tis_mode]))
    for section, (name, inputs) in CORRECTION_FUNCS.items():
        fields = dict(sections[section])
        if "enabled" not in fields:
            raise ValueError(f"algo.corrections.{section} lacks its switch 'enabled', got {sorted(fields)}")
        if fields.pop("enabled"):
            steps.append(_bind_correction(section, fields, name, inputs))
    return CorrectionStack(policy, tuple(steps))
