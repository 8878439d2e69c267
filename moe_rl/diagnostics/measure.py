"""One engine batch against the trainer's recomputation at the same weights.

For a `TrajectoryBatch` the engine generated, the trainer model runs one forward without routing
replay and, when the batch carries the engine's routing, one replaying it (R3). From each
forward come the full-vocabulary log-probs and, when the batch carries sampling masks, the
keep-sampling-mask ones (DeepSeek-V3.2 §3.1), so four modes (`results.MODES`) from two forwards.
Per mode, with ``old_logp`` = the trainer's log-prob and ``rollout_logp`` the engine's:

* `moe_rl.algo.diagnostics.mismatch_metrics`: KL k1/k3, χ² token/sequence, ESS, PPL ratio,
  Pearson of probabilities, max/mean |Δp| (formulas in docs/algorithms.md, "Diagnostics");
* the shares the recipe's corrections would mask at its hyper-parameters: IcePop tokens at
  [low, high], MIS (rejection) sequences and tokens, OPSM sequences (zero update: the current
  policy is the trainer, ``logp = old_logp``; advantages from the recipe's estimator);
* ``outside_top_p_frac``: share of sampled tokens outside the trainer's *own* top-k/top-p set
  (`moe_rl.rollout.sampler.process_logits` on the trainer's logits);
* routing agreement (share of (token, MoE layer) with equal top-k sets): ``routing_agreement``
  compares the routing the trainer *used* (read from the routers' outputs) with the engine's —
  1 under R3 if replay took effect — and ``routing_agreement_natural`` the routers' own choice.

Whatever the batch cannot give is `NotAvailable` with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.algo.corrections import icepop, opsm_mask, rejection_mask
from moe_rl.algo.diagnostics import mismatch_metrics, routing_agreement
from moe_rl.data.packing import MicroBatch, pack_microbatches
from moe_rl.data.trajectory import TrajectoryBatch
from moe_rl.diagnostics.results import METRICS, MODES, NotAvailable, Value
from moe_rl.megatron.forward import forward_logits
from moe_rl.rollout.engine import EngineCapabilities
from moe_rl.rollout.sampler import process_logits
from moe_rl.trainer.logprobs import response_logprobs, routing_mode


@dataclass(frozen=True)
class MeasureParams:
    """Sampling and correction hyper-parameters of the recipe (bound in `from_config`)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    chunk_size: int = 1024
    max_tokens_per_microbatch: int = 4096
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    rejection: dict = field(
        default_factory=lambda: {"divergence": "k1", "aggregation": "seq_mean", "low": 0.999, "high": 1.001}
    )
    opsm_delta: float = 0.1
    off: frozenset[str] = frozenset()
    """The corrections the recipe leaves off (``icepop``, ``mis``, ``opsm``): their shares are said
    as what they would mask, not as what the run masks."""

    @classmethod
    def from_config(cls, config) -> MeasureParams:
        """The recipe's values (correction bands apply whether or not the correction is on)."""
        c, r = config.algo.corrections, config.rollout
        if not r.temperature > 0:
            raise ValueError(
                f"rollout.temperature={r.temperature}: the mismatch test compares sampled "
                "distributions; use a temperature > 0"
            )
        rej = c.rejection
        return cls(
            temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
            chunk_size=config.trainer.logprob_chunk_size,
            max_tokens_per_microbatch=config.trainer.max_tokens_per_microbatch,
            icepop_low=c.icepop.low, icepop_high=c.icepop.high,
            rejection={"divergence": rej.divergence, "aggregation": rej.aggregation,
                       "low": rej.low, "high": rej.high},
            opsm_delta=c.opsm.delta,
            off=frozenset(name for name, on in (("icepop", c.icepop.enabled), ("mis", rej.enabled),
                                                ("opsm", c.opsm.enabled)) if not on),
        )  # fmt: skip


@dataclass(frozen=True)
class Availability:
    """Why routing / sampling masks are missing (None: present)."""

    routing: NotAvailable | None
    sampling_mask: NotAvailable | None


def availability(batch: TrajectoryBatch, caps: EngineCapabilities, has_routers: bool) -> Availability:
    """What the batch carries, with the reason for what it lacks (the engine, the request, the model)."""
    where = f"rollout.engine={caps.engine} on {caps.device}"
    routing = None
    if not has_routers:
        routing = NotAvailable("the model has no MoE layers")
    elif not batch.has_routing:
        routing = NotAvailable(
            f"{where} returns no routed experts" if not caps.routing
            else "the engine returned no routed experts (rollout.return_routing=false)"
        )  # fmt: skip
    mask = None
    if not batch.has_sampling_mask:
        mask = NotAvailable(
            f"{where} returns no sampling masks" if not caps.sampling_mask
            else "the engine returned no sampling masks (rollout.return_sampling_mask=false)"
        )  # fmt: skip
    return Availability(routing, mask)


@dataclass
class TrainerPass:
    """One trainer forward over the whole batch, per response token in the batch's order."""

    logp: Tensor
    logp_ksm: Tensor | None
    outside_top_p: Tensor
    used_routing: list[Tensor] = field(default_factory=list)
    natural_routing: list[Tensor] = field(default_factory=list)
    rollout_routing: list[Tensor] = field(default_factory=list)


@contextmanager
def used_routing(replay) -> Iterator[list[Tensor]]:
    """Collect, per MoE layer, the top-k expert ids the routers actually used (``[T, k]``),
    read from each router's ``routing_map`` output: the replayed ids under R3, their own otherwise."""
    captured: list[Tensor] = []
    if replay is None:
        yield captured
        return
    topk = replay.topk

    def hook(router, args, output) -> None:
        routing_map = output[1].reshape(-1, output[1].shape[-1])
        captured.append(routing_map.float().topk(topk, dim=-1).indices)

    handles = [router.register_forward_hook(hook) for _, router in replay.routers]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def outside_top_p(rows: Tensor, targets: Tensor, params: MeasureParams) -> Tensor:
    """``[R]`` bool: the sampled id is not in the top-k/top-p set of the trainer's logits ``rows``."""
    out = []
    for start in range(0, rows.shape[0], params.chunk_size):
        processed = process_logits(
            rows[start : start + params.chunk_size], params.temperature, params.top_k, params.top_p
        )
        picked = processed.gather(1, targets[start : start + params.chunk_size, None]).squeeze(1)
        out.append(~torch.isfinite(picked))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool, device=rows.device)


def _micro_pass(model, micro: MicroBatch, replay, r3: bool, ksm: bool, params: MeasureParams) -> dict:
    trace = micro.routed_experts.long() if r3 else None
    with routing_mode(replay, trace, micro.num_tokens, natural=r3) as routing, used_routing(replay) as used:
        logits = forward_logits(model, micro)
    positions = micro.response_positions
    targets = micro.input_ids.index_select(0, positions)
    out = {
        "logp": response_logprobs(logits, micro, params.temperature, params.chunk_size),
        "logp_ksm": response_logprobs(logits, micro, params.temperature, params.chunk_size, True)
        if ksm
        else None,
        "outside": outside_top_p(logits.index_select(0, positions - 1), targets, params),
    }
    if replay is not None and micro.routed_experts is not None:
        valid = micro.routing_valid
        out["used"] = torch.stack(used, dim=1)[: micro.num_tokens][valid]
        out["rollout"] = replay.local_layers(micro.routed_experts.long())[valid]
        natural = routing.get("natural")
        out["natural"] = natural[valid] if natural is not None else out["used"]
    return out


@torch.no_grad()
def trainer_pass(
    model, batch: TrajectoryBatch, replay, r3: bool, ksm: bool, params: MeasureParams
) -> TrainerPass:
    """The trainer's forward(s) over ``batch`` in micro-batches (R3: replaying the batch's routing).

    ``batch`` is on the CPU (a trajectory); each micro-batch is moved to the model's device once and
    its results come back to the CPU once."""
    num = batch.num_response_tokens
    logp = torch.zeros(num, device="cpu")
    logp_ksm = torch.zeros(num, device="cpu") if ksm else None
    outside = torch.zeros(num, dtype=torch.bool, device="cpu")
    result = TrainerPass(logp, logp_ksm, outside)
    device = next(model.parameters()).device
    for packed in pack_microbatches(batch, params.max_tokens_per_microbatch):
        micro = packed.to(device)
        out = _micro_pass(model, micro, replay, r3, ksm, params)
        index = packed.response_token_index
        logp[index] = out["logp"].float().cpu()
        outside[index] = out["outside"].cpu()
        if logp_ksm is not None:
            logp_ksm[index] = out["logp_ksm"].float().cpu()
        if "used" in out:
            result.used_routing.append(out["used"].cpu())
            result.rollout_routing.append(out["rollout"].cpu())
            result.natural_routing.append(out["natural"].cpu())
    return result


def correction_shares(
    logp: Tensor,
    rollout_logp: Tensor,
    seq_ids: Tensor,
    num_seqs: int,
    advantages: Tensor | None,
    params: MeasureParams,
) -> dict[str, Value]:
    """Shares IcePop, MIS (rejection) and OPSM would mask at the recipe's hyper-parameters."""
    mask = torch.ones_like(logp, dtype=torch.bool)
    ice = icepop(logp, rollout_logp, mask, low=params.icepop_low, high=params.icepop_high)
    mis = rejection_mask(logp, rollout_logp, mask, seq_ids, num_seqs=num_seqs, **params.rejection)
    out: dict[str, Value] = {
        "icepop_masked_frac": float(ice.metrics["icepop_masked_frac"]),
        "mis_masked_seq_frac": float(mis.metrics["rejection_masked_seq_frac"]),
        "mis_masked_token_frac": float(mis.metrics["rejection_masked_token_frac"]),
    }
    if advantages is None:
        out["opsm_masked_seq_frac"] = NotAvailable("no rewards, so no advantages for OPSM")
    else:
        opsm = opsm_mask(
            logp, rollout_logp, advantages[seq_ids], mask, seq_ids, num_seqs=num_seqs, delta=params.opsm_delta
        )
        out["opsm_masked_seq_frac"] = float(opsm.metrics["opsm_masked_seq_frac"])
    for key, value in out.items():
        name = key.split("_", 1)[0]
        if name in params.off and not isinstance(value, NotAvailable):
            label = {"icepop": "IcePop", "mis": "MIS", "opsm": "OPSM"}[name]
            out[key] = NotAvailable(f"{label} is off in the recipe (it would mask {value:.1%})")
    return out


def routing_metrics(passed: TrainerPass) -> dict[str, Value]:
    used, rollout = torch.cat(passed.used_routing), torch.cat(passed.rollout_routing)
    found = routing_agreement(used, rollout)
    natural = routing_agreement(torch.cat(passed.natural_routing), rollout)
    return {
        "routing_agreement": float(found["routing_agreement"]),
        "routing_overlap": float(found["routing_overlap"]),
        "routing_agreement_natural": float(natural["routing_agreement"]),
    }


def mode_metrics(
    logp: Tensor, passed: TrainerPass, batch: TrajectoryBatch, advantages: Tensor | None,
    params: MeasureParams, routing: NotAvailable | None,
) -> dict[str, Value]:  # fmt: skip
    """Every metric of one mode (see the module docstring)."""
    num_seqs = batch.num_samples
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=logp.device), batch.response_lengths())
    rollout_logp = batch.rollout_logp.float()
    mask = torch.ones_like(logp, dtype=torch.bool)
    out: dict[str, Value] = {
        k: float(v) for k, v in mismatch_metrics(logp, rollout_logp, mask, seq_ids, num_seqs=num_seqs).items()
    }
    out.update(correction_shares(logp, rollout_logp, seq_ids, num_seqs, advantages, params))
    out["outside_top_p_frac"] = float(passed.outside_top_p.float().mean()) if logp.numel() else 0.0
    if routing is not None:
        out.update(
            dict.fromkeys(("routing_agreement", "routing_overlap", "routing_agreement_natural"), routing)
        )
    else:
        out.update(routing_metrics(passed))
    return out


def measure(
    model, batch: TrajectoryBatch, caps: EngineCapabilities, params: MeasureParams,
    advantages: Tensor | None = None, modes: tuple[str, ...] = MODES,
) -> dict[str, dict[str, Value]]:  # fmt: skip
    """Metrics per mode (``plain``, ``ksm``, ``r3``, ``r3+ksm``) of ``batch`` against ``model``.

    ``advantages``: per response (for the OPSM share). Modes the batch cannot support carry a
    `NotAvailable` for every metric. The model is left in the train/eval mode it had.
    """
    replay = _replay_of(model)
    avail = availability(batch, caps, replay is not None)
    ksm = avail.sampling_mask is None and any("ksm" in m for m in modes)
    was_training = model.training
    model.eval()
    try:
        passes = {"plain": trainer_pass(model, batch, replay, False, ksm, params)}
        if avail.routing is None and any(m.startswith("r3") for m in modes):
            passes["r3"] = trainer_pass(model, batch, replay, True, ksm, params)
    finally:
        model.train(was_training)
    results: dict[str, dict[str, Value]] = {}
    for mode in modes:
        missing = (avail.routing if mode.startswith("r3") else None) or (
            avail.sampling_mask if mode.endswith("ksm") else None
        )
        if missing is not None:
            results[mode] = dict.fromkeys(METRICS, missing)
            continue
        passed = passes["r3" if mode.startswith("r3") else "plain"]
        logp = passed.logp_ksm if mode.endswith("ksm") else passed.logp
        results[mode] = mode_metrics(logp, passed, batch, advantages, params, avail.routing)
    return results


def _replay_of(model):
    """A `RoutingReplay` over the model's routers, or None for a dense model."""
    from megatron.core.transformer.moe.router import TopKRouter

    from moe_rl.megatron.replay import RoutingReplay

    unwrapped = getattr(model, "module", model)
    if not any(isinstance(m, TopKRouter) for m in unwrapped.modules()):
        return None
    return RoutingReplay(unwrapped)
