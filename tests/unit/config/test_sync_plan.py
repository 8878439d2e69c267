"""The weight-sync plan (`moe_rl.config.sync_plan`): the route each layout gets, what travels on it,
and a `rollout.sync_transport` the layout cannot use refused with one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import load_recipe
from moe_rl.config.modes import SyncRoute
from moe_rl.config.sync_plan import Senders, SyncPlan, sync_plan, sync_rules

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes" / "tiny_moe.yaml"
APART = ["cluster.nodes=2", "cluster.trainer_nodes=1", "cluster.rollout_nodes=1", "cluster.gpus_per_node=8"]


def _plan(device: str, *overrides: str, in_process: bool = False):
    return sync_plan(load_recipe(TINY, list(overrides)), device, in_process)


@pytest.mark.parametrize(
    ("where", "overrides", "route", "senders"),
    [
        ("cpu", [], SyncRoute.BUCKETS, Senders.OWNERS),
        ("cuda", [], SyncRoute.DEVICE_IPC, Senders.EVERY_RANK),  # Megatron engines on the trainer's GPU
        ("cuda", APART, SyncRoute.BUCKETS, Senders.OWNERS),
        ("cuda", ["parallel.pipeline_model_parallel_size=2", "parallel.trainer_world_size=2"],
         SyncRoute.BUCKETS, Senders.OWNERS),
        ("cuda", ["rollout.engine=vllm"], SyncRoute.VLLM_IPC, Senders.EVERY_RANK),
        ("cuda", ["rollout.engine=vllm", *APART], SyncRoute.VLLM_NCCL, Senders.RANK0),
        ("cpu", ["rollout.engine=vllm"], SyncRoute.BUCKETS, Senders.OWNERS),
    ],
)  # fmt: skip
def test_the_automatic_route_of_each_layout(where, overrides, route, senders):
    plan = _plan(where, *overrides)
    assert plan.route is route and plan.senders == senders and plan.chosen_by.startswith("auto: ")
    assert plan.same_device is (route is SyncRoute.DEVICE_IPC)
    # the probe's full-precision reference model takes buckets unless the engine's route is the device's
    assert plan.route_for(reference=True) is (route if route is SyncRoute.DEVICE_IPC else SyncRoute.BUCKETS)
    assert plan.route_for(reference=False) is route


def test_what_travels_follows_the_engine_and_the_recipe():
    megatron = _plan("cpu", "rollout.quant=fp8_block128")
    assert megatron.quantized_wire and megatron.wire == "fp8_block128 on the wire"
    assert megatron.bucket_bytes == load_recipe(TINY).rollout.sync_bucket_mb << 20
    assert not _plan("cpu", "rollout.quant=bf16").quantized_wire
    assert not _plan("cpu", "rollout.quant=int4_awq").quantized_wire  # calibrated on the engine
    vllm = _plan("cpu", "rollout.engine=vllm", "rollout.quant=fp8_block128")  # vLLM quantizes itself
    assert not vllm.quantized_wire and vllm.wire == "tensors as the trainer holds them"
    assert not _plan("cuda", "rollout.engine=vllm", "rollout.quant=fp8_block128").quantized_wire
    line = megatron.describe()
    assert line.startswith("buckets (shared memory on a sender's node") and "chosen by auto" in line


def test_the_plan_line_in_full_and_who_sends():
    """The driver's line, word for word: the route and its means, what travels in what units of
    how many MiB, who sends, and why; the plan itself cannot be changed once made."""
    import dataclasses

    tiny = _plan("cpu", "rollout.quant=fp8_block128", "rollout.sync_bucket_mb=48")
    assert tiny.describe() == (
        "buckets (shared memory on a sender's node, a process group to other nodes); fp8_block128 on the wire in "
        "buckets of 48 MiB; each trainer rank sends the tensors it owns; chosen by auto: megatron engines on cpu, "
        "colocated"
    )
    apart = _plan("cuda", "rollout.engine=vllm", *APART)
    assert apart.describe() == (
        "vllm_nccl (vLLM's NCCL weight transfer from trainer rank 0); the whole model in the engines' dtype in "
        "vLLM's packed buffers of 256 MiB; trainer rank 0 sends the whole model; chosen by auto: vllm engines on "
        "cuda, on nodes of their own, one pipeline stage"
    )
    assert [p.every_rank for p in (tiny, apart, _plan("cuda"), _plan("cuda", "rollout.engine=vllm"))] == [
        False, False, True, True,
    ]  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny.route = SyncRoute.DEVICE_IPC
    # the one-process loop only where asked for, and adapters only where LoRA sends them
    assert sync_plan(load_recipe(TINY), "cpu").route is SyncRoute.BUCKETS
    in_process = load_recipe(TINY, [f"rollout.sync_transport={SyncRoute.IN_PROCESS.value}"])
    broken = [
        r.name for r in sync_rules(in_process, "cpu") if r.broken
    ]  # the preflight's call: not the loop's
    assert broken == ["sync route chosen by the loop"]
    assert not SyncPlan(SyncRoute.BUCKETS, False, "w", 1, "why").adapters
    assert not _plan("cpu", "lora.sync=adapters").adapters  # lora.rank=0: no adapters to send


def test_an_override_where_it_works_is_taken():
    plan = _plan("cuda", "rollout.sync_transport=buckets")
    assert plan.route is SyncRoute.BUCKETS and plan.chosen_by == "rollout.sync_transport=buckets"
    assert _plan("cuda", "rollout.sync_transport=device_ipc").route is SyncRoute.DEVICE_IPC
    assert _plan("cpu", in_process=True).route is SyncRoute.IN_PROCESS


@pytest.mark.parametrize(
    ("where", "overrides", "in_process", "match"),
    [
        ("cpu", ["rollout.sync_transport=device_ipc"], False,
         r"^rollout.sync_transport=device_ipc on cpu: the route moves weights between GPUs; use "
         r"rollout.sync_transport=auto or buckets$"),
        ("cuda", ["rollout.sync_transport=vllm_ipc"], False,
         r"^rollout.sync_transport=vllm_ipc, rollout.engine=megatron: the route is for rollout.engine=vllm"),
        ("cuda", ["rollout.engine=vllm", "rollout.sync_transport=vllm_nccl"], False,
         r"vllm_nccl, cluster.rollout_nodes=0: the route needs the engines on nodes of their own"),
        ("cuda", ["rollout.sync_transport=device_ipc", *APART], False, r"needs the engines on the trainer's GPUs"),
        ("cuda", ["rollout.sync_transport=device_ipc", "parallel.pipeline_model_parallel_size=2",
                  "parallel.trainer_world_size=2"], False, r"pipeline_model_parallel_size=2: the route sends the whole"),
        ("cpu", ["rollout.sync_transport=in_process"], False, r"the one-process loop's own route"),
        ("cpu", ["rollout.sync_transport=device_ipc"], True, r"one-process loop hands the engine each bucket"),
    ],
)  # fmt: skip
def test_a_route_the_layout_cannot_use_is_refused_naming_the_key(where, overrides, in_process, match):
    config = load_recipe(TINY, overrides)
    assert any(rule.broken for rule in sync_rules(config, where, in_process))
    with pytest.raises(ValueError, match=match):
        sync_plan(config, where, in_process)


LORA = ["lora.rank=8", "lora.sync=adapters"]


@pytest.mark.parametrize(
    ("where", "overrides", "match"),
    [
        ("cuda", [*LORA, "rollout.engine=vllm", "rollout.sync_transport=vllm_ipc"],
         r"lora.sync=adapters with rollout.engine=vllm, rollout.sync_transport=vllm_ipc: vLLM's weight "
         r"transfer loads the model's own weights, not adapters"),
        ("cuda", [*LORA, "rollout.engine=vllm", "cluster.rollout_nodes=1", "rollout.sync_transport=vllm_nccl"],
         r"lora.sync=adapters with rollout.engine=vllm, rollout.sync_transport=vllm_nccl: vLLM's weight "
         r"transfer loads the model's own weights, not adapters"),
        ("cuda", [*LORA, "rollout.engine=vllm", "lora.train_router=true"],
         r"lora.sync=adapters with rollout.engine=vllm, lora.train_router=true: vLLM's LoRA takes "
         r"adapters only.*set lora.train_router=false, or use lora.sync=merged"),
        ("cuda", [*LORA, "rollout.engine=vllm", "lora.train_output_layer=true"],
         r"lora.sync=adapters with rollout.engine=vllm, lora.train_output_layer=true: vLLM's LoRA takes "
         r"adapters only.*set lora.train_output_layer=false, or use lora.sync=merged"),
        ("cuda", [*LORA, "cluster.engine_sleep_level=2"],
         r"lora.sync=adapters with cluster.engine_sleep_level=2: a level-2 sleep drops the engines' weights"),
        ("cpu", [*LORA, "rollout.quant=int4_awq"],
         r"lora.sync=adapters with rollout.quant=int4_awq: AWQ calibrates the weights"),
    ],
    ids=["vllm-transfer", "vllm-nccl-transfer", "vllm-router", "vllm-head", "sleep-level-2", "awq"],
)  # fmt: skip
def test_an_adapter_sync_the_run_cannot_keep_is_refused_naming_the_keys(where, overrides, match):
    config = load_recipe(TINY, overrides)
    with pytest.raises(ValueError, match=match):
        sync_plan(config, where)


def test_an_adapter_sync_is_in_the_plan_and_its_line():
    merged, adapters = _plan("cpu", "lora.rank=8"), _plan("cpu", *LORA)
    assert _plan("cpu", "lora.rank=1", "lora.sync=adapters").adapters  # the least rank there is
    assert not merged.adapters and adapters.adapters and merged.route == adapters.route
    assert "LoRA adapters apart, only what trains once an engine holds the base" in adapters.describe()
    assert "LoRA" not in merged.describe()


def test_adapters_into_vllm_travel_as_buckets():
    """vLLM engines load the adapters through vLLM's LoRA, so the automatic route is buckets where
    merged weights would take vLLM's own transfer."""
    for placement in ([], ["cluster.rollout_nodes=1"]):
        merged = _plan("cuda", "lora.rank=8", "rollout.engine=vllm", *placement)
        adapters = _plan("cuda", *LORA, "rollout.engine=vllm", *placement)
        assert merged.route in (SyncRoute.VLLM_IPC, SyncRoute.VLLM_NCCL)
        assert adapters.route == SyncRoute.BUCKETS and adapters.adapters
        assert "auto: LoRA adapters into vllm engines' own LoRA" in adapters.chosen_by


@pytest.mark.parametrize(
    ("where", "overrides", "in_process", "route"),
    [
        ("cuda", ["rollout.engine=vllm", "rollout.sync_transport=vllm_ipc"], False, SyncRoute.VLLM_IPC),
        ("cuda", ["rollout.engine=vllm", "rollout.sync_transport=vllm_nccl", *APART], False, SyncRoute.VLLM_NCCL),
        ("cuda", ["rollout.sync_transport=buckets", *APART], False, SyncRoute.BUCKETS),
        ("cpu", ["rollout.sync_transport=buckets"], True, SyncRoute.IN_PROCESS),
        ("cpu", [], True, SyncRoute.IN_PROCESS),
        # what refuses an adapter sync elsewhere, where it does not apply
        ("cuda", [*LORA, "cluster.engine_sleep_level=2", *APART], False, SyncRoute.BUCKETS),
        ("cpu", [*LORA, "cluster.engine_sleep_level=2"], False, SyncRoute.BUCKETS),
        ("cuda", [*LORA, "cluster.engine_sleep_level=1"], False, SyncRoute.DEVICE_IPC),
        ("cuda", [*LORA, "lora.train_router=true", "lora.train_output_layer=true"], False, SyncRoute.DEVICE_IPC),
        ("cpu", ["lora.rank=8", "rollout.quant=int4_awq"], False, SyncRoute.BUCKETS),
        ("cuda", [*LORA, "rollout.engine=vllm", "rollout.sync_transport=buckets"], False, SyncRoute.BUCKETS),
        ("cuda", ["lora.rank=8", "rollout.engine=vllm", "lora.train_router=true"], False, SyncRoute.VLLM_IPC),
    ],
    ids=[
        "vllm-ipc", "vllm-nccl", "buckets-apart", "one-process-buckets", "one-process-auto", "lora-sleep2-apart",
        "lora-sleep2-cpu", "lora-sleep1", "lora-whole-megatron", "awq-merged", "lora-vllm-buckets",
        "merged-vllm-router",
    ],
)  # fmt: skip
def test_a_layout_a_route_suits_is_taken_with_no_rule_broken(where, overrides, in_process, route):
    """The other side of each refusal: the same keys where the route or the adapter sync works."""
    config = load_recipe(TINY, overrides)
    assert [rule.message for rule in sync_rules(config, where, in_process) if rule.broken] == []
    assert sync_plan(config, where, in_process).route is route
