"""The algorithm choices a recipe names (``algo.*``), as typed modes: one list of choices each.

Each is a `StrEnum` whose values are the recipe's spelling (``algo.objective: espo``) and whose
names are those values in capitals; the recipe loader turns the YAML strings into members, and
the math compares members, never strings. `moe_rl.algo.registry` binds each member to its
function. Imports nothing.
"""

from __future__ import annotations

from enum import StrEnum


class Objective(StrEnum):
    """The policy loss (``algo.objective``); formulas in `moe_rl.algo.objectives`."""

    PPO_CLIP = "ppo_clip"
    GSPO = "gspo"
    GSPO_TOKEN = "gspo_token"
    CISPO = "cispo"
    REINFORCE = "reinforce"
    ESPO = "espo"
    DGO = "dgo"
    SFT = "sft"
    """Maximum likelihood: every sample of weight 1 (`moe-rl sft`'s demonstrations, which no sampling
    policy wrote: their log-probs and rewards are not read)."""


OFFLINE_OBJECTIVES = frozenset({Objective.DGO, Objective.SFT})
"""The objectives of ``run.mode=offline``: weighted maximum likelihood of stored data, each sample's
weight computed by the driver over the whole batch (`moe_rl.algo.registry.bind_step_advantage`), never
all 0."""


class Advantage(StrEnum):
    """The advantage estimator (``algo.advantage``): group-relative ones the driver computes per
    response (``grpo``, ``dr_grpo``, ``rloo``), or token-level ones the trainer computes in the π_old
    pass from each response's score (``gae`` with a critic, ``reinforce_pp`` and its group-baseline
    variant ``reinforce_pp_baseline``)."""

    GRPO = "grpo"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"
    GAE = "gae"
    REINFORCE_PP = "reinforce_pp"
    REINFORCE_PP_BASELINE = "reinforce_pp_baseline"


class Aggregation(StrEnum):
    """How token losses become one loss (``algo.aggregation``); ``seq_mean_group_mean`` is ESPO's
    own (token mean within an entropy group, mean over groups, mean over responses)."""

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_SUM = "seq_mean_token_sum"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"
    SEQ_MEAN_GROUP_MEAN = "seq_mean_group_mean"


class KLEstimator(StrEnum):
    """The KL penalty's estimator (``algo.kl.estimator``)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    ABS = "abs"
    K3_IS = "k3_is"


class PolicyMode(StrEnum):
    """Which policy the objective's ratio is taken against (``algo.policy_mode``): the trainer's
    recomputed π_old (``decoupled``) or the rollout policy (``bypass``)."""

    DECOUPLED = "decoupled"
    BYPASS = "bypass"


class TISMode(StrEnum):
    """Truncated importance sampling (``algo.corrections.tis.mode``)."""

    OFF = "off"
    TOKEN = "token"
    SEQ = "seq"


class Divergence(StrEnum):
    """The divergence a rejection mask bounds (``algo.corrections.rejection.divergence``)."""

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class RejectionAggregation(StrEnum):
    """Over what a rejection mask decides (``algo.corrections.rejection.aggregation``)."""

    TOKEN = "token"
    SEQ_SUM = "seq_sum"
    SEQ_MEAN = "seq_mean"
    SEQ_MAX = "seq_max"


TOKEN_ADVANTAGES: tuple[Advantage, ...] = (
    Advantage.GAE,
    Advantage.REINFORCE_PP,
    Advantage.REINFORCE_PP_BASELINE,
)
"""Estimators the trainer computes per token in the π_old pass (token rewards, returns, the batch
whitening); the driver hands it each response's score."""

GROUP_ADVANTAGES: tuple[Advantage, ...] = (
    Advantage.GRPO, Advantage.DR_GRPO, Advantage.RLOO, Advantage.REINFORCE_PP_BASELINE,
)  # fmt: skip
"""Estimators that compare a response with the others of its group (a group of one trains nothing)."""


def values(mode: type[StrEnum]) -> tuple[str, ...]:
    """The recipe spellings of a mode, in declaration order."""
    return tuple(member.value for member in mode)


OWN_AGGREGATIONS: dict[Objective, tuple[Aggregation, ...]] = {
    Objective.ESPO: (Aggregation.SEQ_MEAN_GROUP_MEAN,)
}
"""Aggregations only one objective defines; a recipe may choose them for that objective only."""

SHARED_AGGREGATIONS: tuple[Aggregation, ...] = tuple(
    a for a in Aggregation if all(a not in own for own in OWN_AGGREGATIONS.values())
)
"""The aggregations every objective (and the KL term) can use."""

AGGREGATIONS: tuple[str, ...] = tuple(a.value for a in SHARED_AGGREGATIONS)
"""Their recipe spellings."""
