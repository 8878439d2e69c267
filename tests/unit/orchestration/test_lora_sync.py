"""LoRA's adapter-only weight sync (`lora.sync=adapters`) through the in-process loop: the Megatron
engine builds its model with the adapters and takes the frozen base once, then each sync carries
only what trains (the adapters and the output layer trained whole); the run's steps equal those of
the merged sync (bf16 rollouts: the engine computes what the trainer does either way), the engine
holds the trainer's adapters, and a restarted engine (a new process, no weights) is brought up with
everything before it could take only the adapters."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from moe_rl.orchestration.metrics import repeatable

LORA = ["lora.rank=4", "lora.alpha=8", "lora.train_output_layer=true", "rollout.quant=bf16"]


def _run(sync: str, steps: int = 3):
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked
    from tests.unit.trainer.trainer_testing import TINY_MODEL_OVERRIDES, TINY_RECIPE

    config = load_checked(
        TINY_RECIPE,
        [*TINY_MODEL_OVERRIDES, "rollout.batch_size=16", "rollout.group_size=4", *LORA, f"lora.sync={sync}"],
    )
    local = LocalRun(config)
    return local, list(local.run(steps))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_an_adapter_sync_carries_what_trains_and_the_run_equals_the_merged_one():
    from moe_rl.megatron.lora import is_adapter

    _, merged = _run("merged")
    local, adapters = _run("adapters")
    model = local.trainer.model
    everything = _nbytes(p for n, p in model.named_parameters() if not is_adapter(n))
    trained = _nbytes(p for p in model.parameters() if p.requires_grad)
    assert 0 < trained < everything
    for a, b in zip(merged, adapters, strict=True):
        assert (a["sync/adapters_only"], b["sync/adapters_only"]) == (0, 1)
        assert a["sync/bytes"] >= everything and b["sync/bytes"] == trained  # bf16: the tensors as they are
        assert b["sync/bytes_loaded"] == trained  # and what the engine loaded
        # what a sync carried differs (sync/, and the recipe's count of the tensors it passed, quant/)
        same = {k: v for k, v in repeatable(a).items() if not k.startswith(("sync/", "quant/", "time/"))}
        other = {k: v for k, v in repeatable(b).items() if not k.startswith(("sync/", "quant/", "time/"))}
        assert same.keys() == other.keys()
        for key, value in same.items():
            close = value if isinstance(value, str) else pytest.approx(value, rel=1e-5, abs=1e-6)
            assert other[key] == close, key
    engine = local.stages.engines.host.engine.model
    for (name, ours), (their_name, theirs) in zip(
        model.state_dict().items(), engine.state_dict().items(), strict=True
    ):
        assert name == their_name
        if isinstance(ours, torch.Tensor) and not name.endswith("_extra_state"):
            assert torch.equal(ours, theirs), name  # the adapters moved by training, the base as it was


def test_a_restarted_engine_is_brought_up_with_everything_and_a_partial_sync_needs_the_base():
    from moe_rl.orchestration.engine_host import EngineHost

    local, _ = _run("adapters", steps=1)
    engines, sync, version = local.stages.engines, local.stages.sync, local.stages.state.version
    fresh = EngineHost(
        local.config, local.stages.workers.plan, None, 0
    )  # a new process: the recipe's random weights, no base
    fresh.begin_weight_update(version)
    report = local.trainer.stream_weights([fresh], "engine", whole=False)  # what a holding engine takes
    assert report.adapters_only and report.bytes > 0
    with pytest.raises(ValueError, match="weight sync incomplete: .* never arrived"):
        fresh.finish_weight_update(version)
    fresh = EngineHost(local.config, local.stages.workers.plan, None, 0)
    engines.host, engines.replicas[0].actor = fresh, fresh
    sync.bring_up(engines.replicas, version)
    theirs = fresh.engine.model.state_dict()
    for name, ours in local.trainer.model.state_dict().items():
        if isinstance(ours, torch.Tensor) and not name.endswith("_extra_state"):
            assert torch.equal(ours, theirs[name]), name
    assert sync.run(version + 1).adapters_only  # it holds the base now
