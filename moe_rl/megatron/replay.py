"""Routing replay (R2 / R3) through Megatron-core's ``RouterReplay``.

R3 [Rollout Routing Replay, arXiv 2510.11370] replays the rollout engine's top-k expert ids in
the trainer; R2 records the trainer's own routing in the old-logp pass and replays it in the
update passes. Megatron-core implements the mechanism: with ``moe_enable_routing_replay=True``
every ``TopKRouter`` owns a ``RouterReplay`` whose action decides how its top-k is chosen:

* ``RECORD``: route normally and keep the chosen ids (``get_recorded_indices``);
* ``REPLAY_FORWARD``: use the ids given by ``set_target_indices``; the gate weights are
  gathered from the trainer's own scores at those ids, so the router still gets gradients;
* ``REPLAY_BACKWARD``: activation recompute during backward pops the ids of the micro-batches
  in forward order (``set_target_indices`` appends each to a FIFO).

`RoutingReplay` is an adapter over the ``RouterReplay`` instances of *one* model (found by
walking its modules, not Megatron's process-wide instance list, so several models can live in
one process). A trace is ``topk_idx_TLK``: ``[tokens, moe_layers, k]`` over the model's MoE
layers in order, all of them (global numbering); a pipeline stage uses the columns of its own
MoE layers. Tokens are the packed micro-batch's tokens in order (``thd`` layout, batch 1).
Rows past the end of a trace (padding) replay ids ``0..k-1``; their outputs feed no loss.

The fused router (``moe_router_fusion=True``) computes top-k in transformer-engine and skips
``RouterReplay`` silently, so the adapter refuses it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moe_rl.config.modes import ScoreFunction
from moe_rl.megatron.rules import replay_layout_error

log = logging.getLogger(__name__)


def moe_layer_pattern_of(config) -> list[int]:
    """``config.moe_layer_freq`` as a 0/1 list over all layers (1 = MoE layer)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


@dataclass
class Recording:
    """Filled when a `RoutingReplay.record` block exits."""

    topk_idx_TLK: Tensor | None = None
    """``[tokens, local MoE layers, k]`` int64 ids the routers chose."""


@dataclass
class NaturalRouting:
    """The routers' own top-k under replay, filled when `RoutingReplay.natural_routing` exits."""

    per_layer: list[Tensor] = field(default_factory=list)
    topk_idx_TLK: Tensor | None = None
    captured: dict[int, Tensor] = field(default_factory=dict)
    """Router index -> ids of the latest forward (live while the block runs)."""

    def latest(self) -> Tensor | None:
        """``[T, local layers, k]`` of the latest forward (None before any)."""
        if not self.captured:
            return None
        return torch.stack([self.captured[i] for i in range(len(self.captured))], dim=1)


class RoutingReplay:
    """Record and replay the top-k routing of one Megatron GPT model (this pipeline stage).

    Usage::

        replay = RoutingReplay(model)
        with replay.record() as rec:          # old-logp pass, R2
            model(...)
        trace = rec.topk_idx_TLK              # [T, local MoE layers, k]
        with replay.replay(topk_idx_TLK):     # both passes, R3: the engine's full trace
            out = model(...)
            replay.forward_done()             # before backward, when activations are recomputed
            loss.backward()
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module]):
        chunks = list(model) if isinstance(model, Sequence) else [model]
        self.routers = _find_routers(chunks)
        if not self.routers:
            raise ValueError("the model has no MoE router with routing replay enabled")
        config = self.routers[0][1].config
        if config.moe_router_fusion:
            raise ValueError(
                "trainer.moe_router_fusion=True with routing replay: the fused router skips "
                "RouterReplay silently; set trainer.moe_router_fusion=false"
            )
        cp_error = replay_layout_error("on", config.context_parallel_size)
        if cp_error:
            raise ValueError(cp_error)
        pattern = moe_layer_pattern_of(config)
        ordinal = [sum(pattern[:i]) for i in range(len(pattern))]
        self.num_moe_layers = sum(pattern)
        self.layer_columns = [ordinal[layer - 1] for layer, _ in self.routers]
        self.topk = config.moe_router_topk
        self.num_experts = config.num_moe_experts
        self._sp_slice = _sequence_parallel_slice(config)

    @property
    def instances(self):
        """This model's ``RouterReplay`` instances, in layer order."""
        return [router.router_replay for _, router in self.routers]

    # ---------------------------------------------------------------- validation
    def check_trace(self, topk_idx_TLK: Tensor, sample_of_token: Tensor | None = None) -> Tensor:
        """Validate a full-model trace and return it as int64; ValueError names field and sample."""
        if topk_idx_TLK.dim() != 3:
            raise ValueError(
                f"routed_experts must be [tokens, moe_layers, k], got shape {tuple(topk_idx_TLK.shape)}"
            )
        _, layers, k = topk_idx_TLK.shape
        if layers != self.num_moe_layers:
            raise ValueError(f"routed_experts has {layers} MoE layers, the model has {self.num_moe_layers}")
        if k != self.topk:
            raise ValueError(f"routed_experts has top-k {k}, the model routes to moe_router_topk={self.topk}")
        ids = topk_idx_TLK.to(torch.int64)
        bad = (ids < 0) | (ids >= self.num_experts)
        if bool(bad.any()):
            token, layer, slot = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"routed_experts{_where(sample_of_token, token)}: layer {layer} slot {slot} has expert id "
                f"{int(ids[token, layer, slot])}, valid ids are 0..{self.num_experts - 1}"
            )
        srt = ids.sort(dim=-1).values
        dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
        if bool(dup.any()):
            token, layer = (int(x) for x in dup.nonzero()[0])
            raise ValueError(
                f"routed_experts{_where(sample_of_token, token)}: layer {layer} repeats an expert id "
                f"({ids[token, layer].tolist()}); a top-k set has distinct ids"
            )
        return ids

    def _as_full(self, local_TLK: Tensor) -> Tensor:
        """Spread a this-stage trace over all MoE layers (other stages' columns: ids 0..k-1)."""
        if local_TLK.dim() != 3 or local_TLK.shape[1] != len(self.layer_columns):
            raise ValueError(
                f"a local routing trace must be [tokens, {len(self.layer_columns)}, k], "
                f"got shape {tuple(local_TLK.shape)}"
            )
        tokens, _, k = local_TLK.shape
        full = torch.arange(k, dtype=local_TLK.dtype, device=local_TLK.device)
        full = full.expand(tokens, self.num_moe_layers, k).clone()
        full[:, self.layer_columns] = local_TLK
        return full

    def local_layers(self, topk_idx_TLK: Tensor) -> Tensor:
        """The columns of this stage's MoE layers of a full-model trace."""
        return topk_idx_TLK[:, self.layer_columns]

    def _local_columns(self, ids: Tensor, num_tokens: int | None) -> list[Tensor]:
        if num_tokens is not None and num_tokens > ids.shape[0]:
            pad = torch.arange(self.topk, dtype=ids.dtype, device=ids.device)
            pad = pad.expand(num_tokens - ids.shape[0], ids.shape[1], -1)
            ids = torch.cat([ids, pad])
        if self._sp_slice is not None:
            ids = ids[self._sp_slice(ids.shape[0])]
        return [ids[:, col].contiguous() for col in self.layer_columns]

    # ---------------------------------------------------------------- replay
    def set_replay(
        self,
        topk_idx_TLK: Tensor,
        num_tokens: int | None = None,
        sample_of_token: Tensor | None = None,
        local: bool = False,
    ) -> None:
        """Queue one micro-batch's trace and switch the routers to ``REPLAY_FORWARD``.

        ``local``: the trace has this stage's MoE layers only (e.g. recorded here, R2).
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        ids = self.check_trace(self._as_full(topk_idx_TLK) if local else topk_idx_TLK, sample_of_token)
        device = self.routers[0][1].weight.device
        for instance, column in zip(self.instances, self._local_columns(ids, num_tokens)):
            instance.set_target_indices(column.to(device))
            instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def forward_done(self) -> None:
        """Switch to ``REPLAY_BACKWARD``: recompute in backward pops the queued traces in order."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for instance in self.instances:
            instance.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def clear(self) -> None:
        """Forget queued and recorded ids; routers route on their own again."""
        for instance in self.instances:
            instance.clear_indices()
            instance.clear_router_replay_action()

    @contextmanager
    def replay(
        self,
        topk_idx_TLK: Tensor,
        num_tokens: int | None = None,
        sample_of_token: Tensor | None = None,
        local: bool = False,
    ) -> Iterator[RoutingReplay]:
        """Replay ``topk_idx_TLK`` ([tokens, all MoE layers, k]; this stage's only if ``local``)
        for the forward(s) — and backward — in the block."""
        self.set_replay(topk_idx_TLK, num_tokens, sample_of_token, local)
        try:
            yield self
        finally:
            self.clear()

    # ---------------------------------------------------------------- record
    @contextmanager
    def record(self) -> Iterator[Recording]:
        """Record the routers' own top-k in the block's (last) forward: ``[T, local layers, k]``."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        recording = Recording()
        for instance in self.instances:
            instance.set_router_replay_action(RouterReplayAction.RECORD)
        try:
            yield recording
            per_layer = [instance.get_recorded_indices() for instance in self.instances]
            if any(t is None for t in per_layer):
                raise RuntimeError("no forward ran inside RoutingReplay.record()")
            recording.topk_idx_TLK = torch.stack([t.detach().to(torch.int64) for t in per_layer], dim=1)
        finally:
            self.clear()

    # ---------------------------------------------------------------- diagnostics
    @contextmanager
    def natural_routing(self) -> Iterator[NaturalRouting]:
        """Capture what each router would choose on its own during the block's forward.

        Each router's ``routing`` is wrapped for the block: it sees the router logits the forward
        has just computed and runs Megatron's own top-k selection on them without replay (a
        top-k over ``[T, experts]``, no extra GEMM) before the replayed routing proceeds.
        Gives ``[T, local layers, k]`` to compare with the replayed ids (routing agreement).
        """
        natural = NaturalRouting()
        captured = natural.captured
        for i, (_, router) in enumerate(self.routers):
            router.routing = _capturing_routing(router, captured, i)
        try:
            yield natural
            natural.per_layer = [captured[i] for i in range(len(self.routers)) if i in captured]
            if len(natural.per_layer) == len(self.routers):
                natural.topk_idx_TLK = torch.stack(natural.per_layer, dim=1)
        finally:
            for _, router in self.routers:
                del router.routing  # the class's method again


def _capturing_routing(router, captured: dict[int, Tensor], index: int):
    routing = type(router).routing.__get__(router)

    def wrapped(logits: Tensor, *args, **kwargs):
        captured[index] = select_topk(router, logits)
        return routing(logits, *args, **kwargs)

    return wrapped


@torch.no_grad()
def select_topk(router, logits: Tensor) -> Tensor:
    """The top-k expert ids ``router`` selects from its ``logits`` without replay, ``[tokens, k]``.

    The selection of ``moe_utils.topk_routing_with_score_function``, without building its dense
    ``[tokens, experts]`` maps: softmax routers select on the logits (on the softmax with
    ``moe_router_pre_softmax``, which only matters for group scores); sigmoid scores add the
    expert bias for selection; group-limited routing uses Megatron's ``group_limited_topk``. The
    expert order within a row may differ from the router's.
    """
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    config = router.config
    scores = logits.detach().view(-1, config.num_moe_experts)
    if config.moe_router_score_function == ScoreFunction.SIGMOID:
        scores = torch.sigmoid(scores.float())
        if router.expert_bias is not None:
            scores = scores + router.expert_bias
    elif config.moe_router_pre_softmax:
        scores = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if config.moe_router_group_topk:
        _, idx = group_limited_topk(
            scores=scores, topk=config.moe_router_topk, num_tokens=scores.shape[0],
            num_experts=config.num_moe_experts, num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
        )  # fmt: skip
        return idx
    return scores.topk(config.moe_router_topk, dim=-1).indices


def _find_routers(chunks: list[torch.nn.Module]) -> list[tuple[int, torch.nn.Module]]:
    """``(global layer number, TopKRouter)`` of every replay-enabled router, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = []
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "layer_number") and hasattr(module, "mlp"):
                router = getattr(module.mlp, "router", None)
                if isinstance(router, TopKRouter) and router.router_replay is not None:
                    found.append((module.layer_number, router))
    return sorted(found, key=lambda item: item[0])


def _sequence_parallel_slice(config):
    """With sequence parallelism each TP rank routes its own contiguous slice of the tokens."""
    if not config.sequence_parallel or config.tensor_model_parallel_size == 1:
        return None
    from megatron.core import parallel_state as ps

    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()

    def slice_for(num_tokens: int) -> slice:
        if num_tokens % size:
            raise ValueError(f"{num_tokens} tokens do not split over tensor_model_parallel_size={size}")
        chunk = num_tokens // size
        return slice(rank * chunk, (rank + 1) * chunk)

    return slice_for


def _where(sample_of_token: Tensor | None, token: int) -> str:
    if sample_of_token is None:
        return f" (token {token})"
    return f" (sample {int(sample_of_token[token])}, token {token})"


def release_router_replay(model: torch.nn.Module) -> None:
    """Detach a model's routers from Megatron's global ``RouterReplay`` list (for scratch models).

    Every replay-enabled router registers itself in
    ``RouterReplay.global_router_replay_instances`` when built; a short-lived model (e.g. the
    AWQ calibration copy of the Megatron engine) would otherwise stay referenced there forever.
    Its routers then route naturally.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mine = {id(router.router_replay) for _, router in _find_routers([model])}
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in mine
    ]
    for _, router in _find_routers([model]):
        router.router_replay = None
