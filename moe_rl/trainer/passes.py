"""The trainer's passes over micro-batches — π_old, π_ref and the update — at any pipeline size.

A pass is three callbacks per micro-batch, the same whatever the layout:

* ``before(mb)``: set up the routing of this stage's MoE layers (replay the engine's trace under R3
  or the recorded one under R2; record under R2; capture the routers' own choice for the
  agreement metric);
* ``after(mb)``: read what the forward routed (the recording, the natural routing), and switch
  replay to its backward mode (an activation recompute pops the same ids);
* ``on_logits(mb, logits)`` (last stage): log-probs, entropy, mismatch metrics or the loss; returns
  what the backward starts from.

`run_schedule` runs them: with PP = 1 each micro-batch's forward (and backward) in turn, with PP > 1
Megatron's non-interleaved 1F1B schedule (`moe_rl.trainer.pipeline`). Micro-batches are never
edited: the π_old pass returns new ones with its results (`TrainMicroBatch.with_old`).

Per response token ``r`` at packed position ``p`` (docs/algorithms.md, "Log-probabilities"):
``logp_r = z_{p-1}[y_p]/T − logsumexp(z_{p-1}/T)``, over the kept set under keep-sampling-mask;
routing replay and the sampling mask apply in both trainer passes or in neither.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.algo.advantages import zvp_shape
from moe_rl.algo.diagnostics import mismatch_metrics, routing_agreement
from moe_rl.config.modes import ReplayMode
from moe_rl.megatron.forward import check_on_model_device, packed_seq_params, pad_micro_batch, whole_vocab
from moe_rl.megatron.replay import RoutingReplay
from moe_rl.trainer import pipeline
from moe_rl.trainer.batch import TrainMicroBatch
from moe_rl.trainer.logprobs import PassOptions, response_entropy, response_logprobs


class Timer:
    """Accumulates wall time per named phase (for the step-time breakdown)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        import time

        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


@dataclass
class Hooks:
    """The callbacks of one pass (see the module docstring)."""

    before: Callable[[TrainMicroBatch], None]
    after: Callable[[TrainMicroBatch], None]
    on_logits: Callable[[TrainMicroBatch, Tensor], Tensor]
    gather: Callable[[Tensor], Tensor] = whole_vocab
    """What makes the model's output whole on every rank: the vocabulary's shards gathered (a
    critic's values are whole already)."""


def run_schedule(
    model: torch.nn.Module,
    micro_batches: Sequence[TrainMicroBatch],
    forward_only: bool,
    hooks: Hooks,
    pad_length: Callable[[TrainMicroBatch], int | None],
    timer: Timer,
    pipelined: bool,
) -> None:
    """Run ``hooks`` over ``micro_batches``: forward only, or forward and backward of each
    micro-batch's loss (what ``on_logits`` returns)."""
    if pipelined:
        with timer.section("forward_backward"):
            pipeline.run_schedule(
                model, micro_batches, forward_only, hooks.before, hooks.after, hooks.on_logits, pad_length,
                hooks.gather,
            )  # fmt: skip
        return
    for mb in micro_batches:
        check_on_model_device(mb.micro, model)
        with timer.section("forward"):
            tokens, positions, cu = pad_micro_batch(mb.micro, pad_length(mb))
            hooks.before(mb)
            output = model(
                tokens[None], positions[None], attention_mask=None, packed_seq_params=packed_seq_params(cu)
            )
            hooks.after(mb)
            output = hooks.gather(output)
            logits = output.reshape(-1, output.shape[-1])[: mb.micro.num_tokens]
        loss = hooks.on_logits(mb, logits)
        if not forward_only:
            with timer.section("backward"):
                loss.backward()


@dataclass
class PassContext:
    """What every pass of one trainer rank shares: its routing replay adapter, its pass options,
    whether it measures diagnostics, how it pads micro-batches and how it schedules them."""

    replay: RoutingReplay | None
    routing_replay: ReplayMode
    options: PassOptions
    diagnostics: bool
    pipelined: bool
    pad_length: Callable[[TrainMicroBatch], int | None]
    timer: Timer = field(default_factory=Timer)

    @property
    def routed(self) -> bool:
        return self.replay is not None and bool(self.replay.routers)

    def trace_for(self, mb: TrainMicroBatch) -> tuple[Tensor | None, bool]:
        """The routing to replay for ``mb`` and whether it is this stage's layers only."""
        if self.routing_replay == ReplayMode.R3:
            if mb.micro.routed_experts is None:
                raise ValueError(
                    f"algo.routing_replay=r3 but samples {mb.micro.sample_indices.tolist()} carry no "
                    "routed_experts; the rollout engine must return routing (rollout.return_routing)"
                )
            return mb.micro.routed_experts, False
        if self.routing_replay == ReplayMode.R2 and mb.recorded_routing is not None:
            return mb.recorded_routing, True
        return None, False

    def agreement(self, natural: Tensor | None, trace: Tensor | None, local: bool, mb) -> dict[str, Tensor]:
        """Routing agreement of the routers' own choice with the replayed trace."""
        if natural is None or trace is None or self.replay is None:
            return {}
        replayed = trace.long() if local else self.replay.local_layers(trace.long())
        return routing_agreement(natural, replayed[: natural.shape[0]], mb.micro.routing_valid)

    def padded(self, micro_batches: Sequence[TrainMicroBatch]) -> Callable[[TrainMicroBatch], int | None]:
        """The token count of each micro-batch after padding (asked once per micro-batch, in order:
        it is a collective over the expert-parallel group)."""
        lengths = {id(mb): self.pad_length(mb) for mb in micro_batches}
        return lambda mb: lengths[id(mb)]


class _Natural:
    """Captures the routers' own choice over one micro-batch's forward (entered in ``before``,
    read and left in ``after``)."""

    def __init__(self) -> None:
        self.open: dict[int, tuple] = {}

    def enter(self, replay: RoutingReplay, mb: TrainMicroBatch) -> None:
        ctx = replay.natural_routing()
        self.open[id(mb)] = (ctx, ctx.__enter__())

    def leave(self, mb: TrainMicroBatch) -> Tensor | None:
        if id(mb) not in self.open:
            return None
        ctx, natural = self.open.pop(id(mb))
        latest = natural.latest()
        ctx.__exit__(None, None, None)
        return None if latest is None else latest[: mb.micro.num_tokens]

    def close(self) -> None:
        for ctx, _ in self.open.values():
            ctx.__exit__(None, None, None)
        self.open.clear()


def old_pass(
    ctx: PassContext, model: torch.nn.Module, micro_batches: Sequence[TrainMicroBatch], step: int,
    entropy: bool, shape_zero_variance: Callable[[TrainMicroBatch, Tensor | None], tuple[Tensor, dict]],
) -> tuple[list[TrainMicroBatch], list[dict[str, Tensor]]]:  # fmt: skip
    """π_old over ``micro_batches`` (no grad): log-probs, entropy when asked, the recorded routing
    under R2, RL-ZVP's shaped advantages and, with diagnostics, the mismatch and routing-agreement
    metrics. Returns new micro-batches carrying them, and per micro-batch its metrics."""
    options = dataclasses.replace(ctx.options, entropy=entropy)
    record = ctx.routing_replay == ReplayMode.R2
    computed: dict[int, dict] = {id(mb): {"old_weights_version": step} for mb in micro_batches}
    found: dict[int, dict[str, Tensor]] = {id(mb): {} for mb in micro_batches}
    recordings: dict[int, tuple] = {}
    natural = _Natural()
    pad_length = ctx.padded(micro_batches)

    def before(mb: TrainMicroBatch) -> None:
        trace, local = (None, False) if record else ctx.trace_for(mb)
        if ctx.routed and record:
            rec = ctx.replay.record()
            recordings[id(mb)] = (rec, rec.__enter__())
        elif ctx.routed and trace is not None:
            ctx.replay.set_replay(trace, pad_length(mb) or mb.micro.num_tokens, mb.sample_of_token, local)
            if ctx.diagnostics:
                natural.enter(ctx.replay, mb)

    def after(mb: TrainMicroBatch) -> None:
        if id(mb) in recordings:
            rec, recording = recordings.pop(id(mb))
            rec.__exit__(None, None, None)
            computed[id(mb)]["recorded_routing"] = recording.topk_idx_TLK[: mb.micro.num_tokens]
            return
        captured = natural.leave(mb)
        if captured is not None:
            trace, local = ctx.trace_for(mb)
            agreement = ctx.agreement(captured, trace, local, mb)
            computed[id(mb)]["old_routing_metrics"] = agreement
            found[id(mb)].update(agreement)

    def on_logits(mb: TrainMicroBatch, logits: Tensor) -> Tensor:
        out = computed[id(mb)]
        logp = response_logprobs(
            logits, mb.micro, options.temperature, options.chunk_size, options.keep_sampling_mask
        ).detach()
        ent = (
            response_entropy(logits, mb.micro, options.temperature, options.chunk_size)
            if options.entropy
            else None
        )
        out.update(old_logp=logp, old_entropy=ent)
        out["advantages"], shaped = shape_zero_variance(mb, ent)
        found[id(mb)].update(shaped)
        if ctx.diagnostics:
            with ctx.timer.section("diagnostics"):
                mask = torch.ones_like(logp, dtype=torch.bool)
                found[id(mb)].update(
                    mismatch_metrics(logp, mb.micro.rollout_logp, mask, mb.seq_ids, num_seqs=mb.num_samples)
                )
        return logits.new_zeros(())

    try:
        with torch.no_grad():
            run_schedule(
                model,
                micro_batches,
                True,
                Hooks(before, after, on_logits),
                pad_length,
                ctx.timer,
                ctx.pipelined,
            )
    finally:
        natural.close()
        if ctx.replay is not None:
            ctx.replay.clear()
    prepared = [mb.with_old(**computed[id(mb)]) for mb in micro_batches]
    return prepared, [found[id(mb)] for mb in micro_batches]


def reference_pass(
    ctx: PassContext, reference, micro_batches: Sequence[TrainMicroBatch], field: str = "ref_logp"
) -> list[TrainMicroBatch]:
    """A frozen model's log-probs of every micro-batch (no grad), with the kept sets of the π_old
    pass just run and, when it replays (π_ref), its routing: R3 replays the engine's routing, R2
    what the policy recorded. Returns new micro-batches with them as ``field`` (π_ref's
    ``ref_logp``, the distillation teacher's ``teacher_logp``, which routes by its own routers)."""
    options = ctx.options
    replay = reference.replay
    ref_logp: dict[int, Tensor] = {}
    pad_length = ctx.padded(micro_batches)

    def before(mb: TrainMicroBatch) -> None:
        trace, local = ctx.trace_for(mb)
        if replay is not None and trace is not None:
            replay.set_replay(trace, pad_length(mb) or mb.micro.num_tokens, mb.sample_of_token, local)

    def after(mb: TrainMicroBatch) -> None:
        return None

    def on_logits(mb: TrainMicroBatch, logits: Tensor) -> Tensor:
        ref_logp[id(mb)] = response_logprobs(
            logits, mb.micro, options.temperature, options.chunk_size, options.keep_sampling_mask,
            validate_mask=False,  # the policy's pass has checked the kept sets
        )  # fmt: skip
        return logits.new_zeros(())

    try:
        with torch.no_grad():
            run_schedule(
                reference.model, micro_batches, True, Hooks(before, after, on_logits), pad_length, ctx.timer,
                ctx.pipelined,
            )  # fmt: skip
    finally:
        if replay is not None:
            replay.clear()
    return [mb.with_old(**{field: ref_logp.get(id(mb))}) for mb in micro_batches]  # last stage only


def update_pass(
    ctx: PassContext, model: torch.nn.Module, mini_batch: Sequence[TrainMicroBatch], step: int,
    micro_loss: Callable[[TrainMicroBatch, Tensor], tuple[Tensor, dict[str, Tensor]]],
) -> tuple[Tensor, list[dict[str, Tensor]]]:  # fmt: skip
    """Forward and backward of a mini-batch under the recipe's routing: ``(loss_sum, metrics per
    micro-batch)``; the gradients are left in the model."""
    found: dict[int, dict[str, Tensor]] = {id(mb): {} for mb in mini_batch}
    loss_sum = torch.zeros((), device=next(model.parameters()).device)
    natural = _Natural()
    pad_length = ctx.padded(mini_batch)

    def known_agreement(mb: TrainMicroBatch) -> dict | None:
        """The π_old pass's routing agreement when the weights have not moved since: the update
        replays the same ids through the same routers (no need to capture them again)."""
        return mb.old_routing_metrics if mb.old_weights_version == step and mb.old_routing_metrics else None

    def before(mb: TrainMicroBatch) -> None:
        trace, local = ctx.trace_for(mb)
        if ctx.routed and trace is not None:
            ctx.replay.set_replay(trace, pad_length(mb) or mb.micro.num_tokens, mb.sample_of_token, local)
            if ctx.diagnostics and known_agreement(mb) is None:
                natural.enter(ctx.replay, mb)

    def after(mb: TrainMicroBatch) -> None:
        trace, local = ctx.trace_for(mb)
        if not ctx.routed or trace is None:
            return
        ctx.replay.forward_done()  # a recompute in this micro-batch's backward replays its ids
        known = known_agreement(mb)
        captured = natural.leave(mb)
        if captured is not None:
            known = ctx.agreement(captured, trace, local, mb)
        found[id(mb)].update(known or {})

    def on_logits(mb: TrainMicroBatch, logits: Tensor) -> Tensor:
        nonlocal loss_sum
        logp = response_logprobs(
            logits, mb.micro, ctx.options.temperature, ctx.options.chunk_size, ctx.options.keep_sampling_mask,
            validate_mask=mb.old_logp is None,  # the π_old pass has checked the kept sets
        )  # fmt: skip
        micro, metrics = micro_loss(mb, logp)
        found[id(mb)].update(metrics)
        loss_sum = loss_sum + micro.detach().float()
        return micro

    try:
        run_schedule(
            model, mini_batch, False, Hooks(before, after, on_logits), pad_length, ctx.timer, ctx.pipelined
        )
    finally:
        natural.close()
        if ctx.replay is not None:
            ctx.replay.clear()
    return loss_sum, [found[id(mb)] for mb in mini_batch]


def value_pass(
    ctx: PassContext, model: torch.nn.Module, micro_batches: Sequence[TrainMicroBatch], forward_only: bool,
    on_values: Callable[[TrainMicroBatch, Tensor], Tensor],
) -> None:  # fmt: skip
    """A critic's pass (`moe_rl.trainer.critic`): ``on_values(mb, values [R])`` on the last stage
    with the value at each response token's state (the output at the position before the token,
    where the policy's logits predict it), returning what the backward starts from. The critic
    routes by its own routers: no replay, no capture."""

    def on_output(mb: TrainMicroBatch, output: Tensor) -> Tensor:
        return on_values(mb, output[:, 0].index_select(0, mb.micro.response_positions - 1))

    def nothing(mb: TrainMicroBatch) -> None:
        return None

    hooks = Hooks(nothing, nothing, on_output, gather=lambda output: output)
    run_schedule(
        model, micro_batches, forward_only, hooks, ctx.padded(micro_batches), ctx.timer, ctx.pipelined
    )


def shape_zero_variance(alpha: float) -> Callable[[TrainMicroBatch, Tensor | None], tuple[Tensor, dict]]:
    """RL-ZVP: the advantages of tokens in zero-variance groups from π_old's entropy (the driver
    marked their samples, `TrainMicroBatch.zvp_sign`), and the share of tokens shaped; the
    advantages as they are for a micro-batch without signs."""

    def shape(mb: TrainMicroBatch, entropy: Tensor | None) -> tuple[Tensor, dict]:
        if mb.zvp_sign is None:
            return mb.advantages, {}
        assert entropy is not None, "the trainer's rules ask for π_old's entropy with RL-ZVP"
        shaped = zvp_shape(
            mb.advantages, entropy, torch.ones_like(mb.advantages, dtype=torch.bool), mb.seq_ids,
            num_seqs=mb.num_samples, signs=mb.zvp_sign, alpha=alpha,
        )  # fmt: skip
        return shaped, {"zvp_token_share": (mb.zvp_sign[mb.seq_ids] != 0).float().mean()}

    return shape
