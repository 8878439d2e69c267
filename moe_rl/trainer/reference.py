"""The reference policy π_ref of the KL penalty (``algo.kl.coef > 0``): the run's starting weights,
frozen.

`ReferencePolicy` holds a second Megatron ``GPTModel`` built as the policy is (same class, same
transformer config, same parallel layout: each rank holds the same shard of the same layers as its
policy), with the policy's weights copied in before the first optimizer step, so π_ref is whatever
the run starts from (the seed's initialization or ``model.hf_path``). It is frozen: eval mode, no
gradients, in no optimizer, not wrapped in ``DistributedDataParallel``.

Its log-probs (``ref_logp``) come right after the π_old pass (`moe_rl.trainer.passes.
reference_pass`), under the routing and kept sets of the policy's pass: R3 replays the engine's
routing, R2 the routing the policy recorded in that pass, keep-sampling-mask normalizes over the
engine's kept sets. The reference has its own `RoutingReplay` (the adapter is per model).

Offload (``algo.kl.offload_reference``, GPU trainers): the parameters live in pinned host memory
and are copied to the trainer's device for each pass (`resident`). The weights never change after
the start (or a resume), so the host copy is written then and dropping the device copy after a
pass costs nothing. On a CPU trainer there is nothing to offload.

Checkpoints: `sharded_state_dict` puts the weights under ``reference.`` keys next to the policy's,
so a resumed run keeps the original starting weights whatever seed or HF path it starts from.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

from moe_rl.config.modes import ReplayMode
from moe_rl.config.schema import RecipeConfig
from moe_rl.megatron.lora import is_adapter
from moe_rl.megatron.model import build_gpt_model
from moe_rl.megatron.replay import RoutingReplay

PREFIX = "reference."
"""Checkpoint keys of the reference's weights."""


class ReferencePolicy:
    """The frozen reference model of one trainer rank (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, offload: bool, replay: bool):
        """``model``: built like the policy, holding the starting weights. ``offload``: keep the
        weights in host memory between passes (only where ``device`` is a GPU). ``replay``: the
        recipe replays routing (R2 / R3)."""
        self.model = model.eval().requires_grad_(False)
        self.device = device
        self.replay = RoutingReplay(model) if replay else None
        self._params = list(model.parameters())
        self._host: list[Tensor] | None = None
        if offload and device.type == "cuda":
            self._host = [
                torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True).copy_(p.detach())
                for p in self._params
            ]
            self._drop_device_copies()

    @classmethod
    def of_policy(
        cls, policy: torch.nn.Module, config: RecipeConfig, device: torch.device
    ) -> ReferencePolicy:
        """A copy of ``policy``'s current weights (call before the first step) in a model built as
        the policy was. The build draws the same initialization from the same seed as the
        policy's did, so the random state after it is the one the policy's build left."""
        model = build_gpt_model(config.model, config.parallel, config.trainer, seed=config.run.seed)
        # with LoRA the policy's own weights (its adapters start at zero, so they add nothing)
        model.load_state_dict({k: v for k, v in policy.state_dict().items() if not is_adapter(k)})
        offload = config.algo.kl.offload_reference
        return cls(model, device, offload=offload, replay=config.algo.routing_replay != ReplayMode.OFF)

    @property
    def offloaded(self) -> bool:
        """The weights are in host memory now (between passes, with offload)."""
        return self._host is not None and self._params[0].device.type == "cpu"

    def _drop_device_copies(self) -> None:
        for param, host in zip(self._params, self._host):
            param.data = host

    @contextmanager
    def resident(self) -> Iterator[torch.nn.Module]:
        """The model with its weights on the trainer's device for the block: copied there from
        host memory and dropped after when offloading; otherwise they stay where they are."""
        if not self.offloaded:
            yield self.model
            return
        for param, host in zip(self._params, self._host):
            param.data = host.to(self.device, non_blocking=True)
        try:
            yield self.model
        finally:
            self._drop_device_copies()

    # ------------------------------------------------------------------ checkpoints
    def sharded_state_dict(self) -> dict:
        """The weights for Megatron ``dist_checkpointing``, under ``reference.`` keys."""
        return self.model.sharded_state_dict(prefix=PREFIX)

    def load_sharded(self, state: dict) -> None:
        """Take the weights `sharded_state_dict` saved (call inside `resident`: the host copy is
        refreshed from them when offloading)."""
        self.model.load_state_dict({key.removeprefix(PREFIX): value for key, value in state.items()})
        if self._host is not None:
            for param, host in zip(self._params, self._host):
                host.copy_(param.detach())


def saved_with_reference(directory: str | Path) -> bool:
    """Whether the checkpoint in ``directory`` holds reference weights (saved with a KL penalty)."""
    from megatron.core import dist_checkpointing

    return any(key.startswith(PREFIX) for key in dist_checkpointing.load_tensors_metadata(str(directory)))
