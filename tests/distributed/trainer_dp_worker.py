"""Rank body for tests/distributed/test_trainer_dp.py: one gradient accumulation of the tiny MoE
on a share of a fixed global batch, gradients saved under global (HF) tensor names; then PPO with a
critic on the same share (its values, returns, advantages and its step: `critic_outputs`) and
on-policy distillation from a wider teacher (`distill_outputs`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))

GLOBAL_MICRO_BATCHES = 4

PPO = (
    "algo.advantage=gae", "rollout.group_size=1", "critic.lr=1e-3", "algo.gae.gamma=0.9",
    "algo.gae.lam=0.5", "critic.warmup_steps=1", "critic.grad_clip=100",
)  # fmt: skip
"""PPO with a critic; its first step is the warm-up's (the critic's alone), its clip a real norm
that does not bind."""


def recipe(world: int, ep: int, hf_path: str | None = None, pp: int = 1, *extra: str):
    from trainer_testing import tiny_recipe

    overrides = [f"model.hf_path={hf_path}"] if hf_path else []
    return tiny_recipe(
        f"parallel.trainer_world_size={world}",
        f"parallel.expert_model_parallel_size={ep}",
        f"parallel.pipeline_model_parallel_size={pp}",
        "trainer.grad_clip=0",
        *overrides,
        *extra,
    )


def write_weights(folder: str) -> None:
    """One set of weights for every layout (random init depends on how experts are split)."""
    from moe_rl.megatron.hf_weights import save_hf_checkpoint
    from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config

    config = recipe(1, 1)
    save_hf_checkpoint(build_gpt_model(config.model, seed=3), folder, model_config_to_hf_config(config.model))


def global_batch(config):
    from trainer_testing import micro_batches

    return micro_batches(21, 16, config.model, max_tokens=40, num_microbatches=GLOBAL_MICRO_BATCHES)


def shard(batches, rank: int, world: int, even: bool):
    """Uneven token counts per rank; with ``even`` the same number of micro-batches per rank
    (expert parallelism runs collectives inside every forward)."""
    if world == 1:
        return list(batches)
    return [batches[0], batches[3]] if rank == 0 and even else ([batches[0]] if rank == 0 else batches[1:])


LORA = ("lora.rank=4", "lora.alpha=8")

TEACHER = ("model.hidden_size=48", "algo.routing_replay=off")
"""The teacher of the distillation case: the tiny model half again as wide, weights of its own."""


def write_teacher(folder: str) -> tuple[str, str]:
    """The teacher as a Hugging Face folder and the recipe file of its architecture."""
    from moe_rl.config.loader import to_yaml
    from moe_rl.megatron.hf_weights import save_hf_checkpoint
    from moe_rl.megatron.model import build_gpt_model, model_config_to_hf_config

    config = recipe(1, 1, None, 1, *TEACHER)
    weights = Path(folder) / "hf"
    save_hf_checkpoint(
        build_gpt_model(config.model, seed=11), str(weights), model_config_to_hf_config(config.model)
    )
    (Path(folder) / "teacher.yaml").write_text(to_yaml(config))
    return str(weights), str(Path(folder) / "teacher.yaml")


def distill_recipe(world: int, hf_path: str, teacher: tuple[str, str]):
    weights, model_recipe = teacher
    return recipe(
        world,
        1,
        hf_path,
        1,
        "algo.distill.coef=0.5",
        f"teacher.path={weights}",
        f"teacher.model_recipe={model_recipe}",
    )


def distill_outputs(config, mine: list[int]) -> dict[str, torch.Tensor]:
    """On-policy distillation (``config``) on the micro-batches ``mine`` of this rank: the π_old
    pass's ``distill/reverse_kl`` (``__old__/``) and each micro-batch's ``advantages``, ``old_logp``
    and ``teacher_logp`` (``__mb{i}__/``)."""
    from moe_rl.trainer.worker import TrainerWorker

    worker = TrainerWorker(config)
    batches = global_batch(config)
    prepared, old = worker.compute_old_logp([batches[i] for i in mine])
    out = {"__old__/distill/reverse_kl": torch.tensor(old["distill/reverse_kl"], dtype=torch.float64)}
    for i, mb in zip(mine, prepared):
        out |= {f"__mb{i}__/{k}": getattr(mb, k).clone() for k in ("advantages", "old_logp", "teacher_logp")}
    return out


def _global_key(model, name: str) -> str:
    """A parameter's layout-free name: its HF names (an adapter's: its weight's, plus its own)."""
    from moe_rl.megatron.hf_weights import hf_names_for
    from moe_rl.megatron.lora import is_adapter

    if is_adapter(name):
        base, own = name.rsplit(".", 1)
        return "+".join(hf_names_for(model, f"{base}.weight").hf) + f".{own}"
    return "+".join(hf_names_for(model, name).hf)


def _set_adapters(model) -> None:
    """Every LoRA adapter's A and B drawn from its global name: the same values in every layout
    (B not zero, so A has a gradient too)."""
    import zlib

    from moe_rl.megatron.lora import is_adapter

    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name):
                generator = torch.Generator().manual_seed(zlib.crc32(_global_key(model, name).encode()))
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def gradients(
    world: int,
    rank: int,
    ep: int,
    hf_path: str,
    kept: dict | None = None,
    gemm: str = "torch",
    lora: bool = False,
) -> dict[str, torch.Tensor]:
    """The gradients of this rank's share (``kept``, when given, receives the worker's ``model``),
    its experts multiplied as ``trainer.expert_gemm=gemm`` says; with ``lora``, of LoRA adapters on
    every target (`_set_adapters`), the only parameters that train."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_rl.megatron.grouped_experts import GroupedExperts
    from moe_rl.trainer.worker import TrainerWorker

    config = recipe(world, ep, hf_path, 1, f"trainer.expert_gemm={gemm}", *(LORA if lora else ()))
    worker = TrainerWorker(config)
    if lora:
        _set_adapters(worker.model)
    kinds = {type(m) for m in worker.model.modules() if isinstance(m, SequentialMLP)}
    assert kinds == {GroupedExperts if gemm == "torch" else SequentialMLP}, kinds
    batches = global_batch(config)
    if ep > 1:
        mine = [batches[0], batches[3]] if rank == 0 else [batches[1], batches[2]]
    else:
        mine = shard(batches, rank, world, even=False)
    mine, _ = worker.compute_old_logp(mine)
    worker.accumulate_gradients(mine)
    grads = {}
    for name, param in worker.model.named_parameters():
        if param.requires_grad:
            grads[_global_key(worker.model, name)] = param.main_grad.detach().clone()
        else:  # frozen under LoRA: no gradient buffer
            assert lora and not hasattr(param, "main_grad"), name
    if kept is not None:
        kept["model"] = worker.model
    return grads


def sent_to_vllm(model) -> dict:
    """What this rank sends by vLLM's NCCL transfer (`moe_rl.weight_sync.vllm_transfer.TrainerSource`,
    as a trainer rank builds it): its metadata, then its tensors (every rank iterates together); and
    what it shares by vLLM's IPC transfer (every rank the whole model)."""
    from moe_rl.weight_sync.outgoing import sends
    from moe_rl.weight_sync.vllm_transfer import source

    weights = source(model, torch.bfloat16, "cpu", select=sends)
    meta = [(m.name, m.dtype, m.shape) for m in weights.metadata()]
    everywhere = source(model, torch.bfloat16, "cpu", every_rank=True)  # as for vLLM's IPC transfer
    return {
        "meta": meta, "sent": [(name, tensor.clone()) for name, tensor in weights],
        "shared": [(name, tensor.clone()) for name, tensor in everywhere],
    }  # fmt: skip


def sent_by_device_ipc(model, rank: int) -> dict:
    """What the engine that shares this rank's device receives from it by `DeviceIpc` (the whole
    model, every rank streaming at once): buckets pickled as Ray hands them, read through their
    handles. Twice: every rank with an engine, then only rank 0 (rank 1's device hosts none: it
    only joins the gathers)."""
    import pickle

    from moe_rl.config.modes import SyncRoute
    from moe_rl.config.schema import QuantConfig
    from moe_rl.config.sync_plan import SyncPlan
    from moe_rl.weight_sync.receiver import decoded
    from moe_rl.weight_sync.sender import RankSender
    from moe_rl.weight_sync.transport import Receiver

    plan = SyncPlan(
        SyncRoute.DEVICE_IPC, False, "bf16", 16 << 10, "the device route (torch shares CPU buffers)"
    )
    sender = RankSender(model, QuantConfig(), num_layers=2, plan=plan, rank=rank)
    out: dict = {"both": [], "alone": []}
    try:
        for key in ("both", "alone"):
            got = out[key]

            def engine(bucket, got=got):
                got.extend((n, t.clone()) for n, t in decoded(pickle.loads(pickle.dumps(bucket))))

            receivers = {0: Receiver(engine)} if key == "both" or rank == 0 else {}
            report = sender.send(receivers, timeout_s=60.0)
            out[f"{key}_transports"] = sorted(report.transports)
    finally:
        sender.close()
    return out


def sent_by_owners(model, rank: int) -> dict:
    """What this rank delivers on the routes where each trainer rank sends the tensors it owns
    (`outgoing.owned`, here through the one-process route's transport): its tensors, HF-named, each
    expert by its global index, and the transports it used."""
    from moe_rl.config.modes import SyncRoute
    from moe_rl.config.schema import QuantConfig
    from moe_rl.config.sync_plan import SyncPlan
    from moe_rl.weight_sync.receiver import decoded
    from moe_rl.weight_sync.sender import RankSender
    from moe_rl.weight_sync.transport import Receiver

    plan = SyncPlan(SyncRoute.IN_PROCESS, False, "fp32", 16 << 10, "each rank sends what it owns")
    sender = RankSender(model, QuantConfig(), num_layers=2, plan=plan, rank=rank)
    got: list = []
    try:
        report = sender.send({0: Receiver(lambda b: got.extend((n, t.clone()) for n, t in decoded(b)))})
    finally:
        sender.close()
    return {"tensors": got, "transports": sorted(report.transports)}


def critic_outputs(config, mine: list[int], train: bool = True) -> dict[str, torch.Tensor]:
    """PPO with a critic (``config``) on the micro-batches ``mine`` (indices into the global batch)
    of this rank: the π_old pass's ``old_values``, ``returns`` and whitened ``advantages`` of each
    (``__mb{i}__/``, on the last pipeline stage) and its ``returns/*``, ``advantage/*`` metrics
    (``__old__/``); with ``train``, one step (the critic's warm-up step): its ``critic/loss``,
    ``critic/grad_norm``, ``critic/update_ok`` (``__train__/``), its gradients (global names) and
    its updated weights (``__param__/``). The value head is set to a fixed, non-zero vector first
    (it starts at zero: values of 0 would hide a layout's error)."""
    from megatron.core import parallel_state as ps

    from moe_rl.megatron.hf_weights import hf_names_for
    from moe_rl.trainer.critic import ValueHead
    from moe_rl.trainer.worker import TrainerWorker

    worker = TrainerWorker(config)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    if last:
        head = worker.critic.model.output_layer
        assert isinstance(head, ValueHead)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5)))
    batches = global_batch(config)
    prepared, old = worker.compute_old_logp([batches[i] for i in mine])
    statistics = {k: v for k, v in old.items() if k.startswith(("returns/", "advantage/"))}
    out = {"__old__/" + k: torch.tensor(v, dtype=torch.float64) for k, v in statistics.items()}
    assert len(out) == 5, sorted(old)
    for i, mb in zip(mine, prepared):
        if last:
            assert mb.old_values is not None and mb.old_values.abs().sum() > 0
            out |= {f"__mb{i}__/{k}": getattr(mb, k).clone() for k in ("old_values", "returns", "advantages")}
    if not train:
        return out
    step = worker.train_step(prepared)
    assert step["train/policy_frozen"] == 1.0
    out |= {"__train__/" + k: torch.tensor(step[k], dtype=torch.float64) for k in CRITIC_STEP}
    for name, param in worker.critic.model.named_parameters():
        key = "+".join(hf_names_for(worker.critic.model, name).hf)
        out[key] = param.main_grad.detach().clone()
        out["__param__/" + key] = param.detach().clone()
    return out


CRITIC_STEP = ("critic/loss", "critic/grad_norm", "critic/update_ok")


def rank_main(
    rank: int, world: int, port: int, eps: list[int], hf_path: str, out_dir: str, teacher: tuple[str, str]
) -> None:
    """For each expert-parallel size of ``eps`` in turn, in one process (Megatron's groups made again
    for each): the gradients, what the rank sends to vLLM and to a Megatron engine, the critic's
    outputs on the rank's micro-batches, LoRA's gradients (`grads.<ep>.<rank>.pt`,
    `sent.<ep>.<rank>.pt`, `critic.<ep>.<rank>.pt`, `lora.<ep>.<rank>.pt`); at EP 1 also the
    distillation's outputs from ``teacher`` (`write_teacher`: `distill.<rank>.pt`); then which rank
    sends at CP=2 (`senders_at_cp2`: `sends_cp2.<rank>.pt`)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from megatron.core import parallel_state as ps

    for ep in eps:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        kept: dict = {}
        torch.save(gradients(world, rank, ep, hf_path, kept), Path(out_dir) / f"grads.{ep}.{rank}.pt")
        sent = {**sent_to_vllm(kept["model"]), "ipc": sent_by_device_ipc(kept["model"], rank)}
        sent["owners"] = sent_by_owners(kept["model"], rank)
        torch.save(sent, Path(out_dir) / f"sent.{ep}.{rank}.pt")
        mine = ([0, 3] if rank == 0 else [1, 2]) if ep > 1 else ([0] if rank == 0 else [1, 2, 3])
        critic = critic_outputs(recipe(world, ep, hf_path, 1, *PPO), mine)
        torch.save(critic, Path(out_dir) / f"critic.{ep}.{rank}.pt")
        torch.save(gradients(world, rank, ep, hf_path, lora=True), Path(out_dir) / f"lora.{ep}.{rank}.pt")
        if ep == 1:
            distill = distill_outputs(distill_recipe(world, hf_path, teacher), mine)
            torch.save(distill, Path(out_dir) / f"distill.{rank}.pt")
    torch.save(senders_at_cp2(), Path(out_dir) / f"sends_cp2.{rank}.pt")


SENT_NAMES = (
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.mlp.experts.linear_fc1.weight0",
)


def senders_at_cp2() -> dict[str, bool]:
    """Whether this rank sends a dense and an expert tensor (`outgoing.sends`) with the two ranks
    one context-parallel group (Megatron's groups made again: CP=2, DP=1)."""
    from megatron.core import parallel_state as ps

    from moe_rl.weight_sync.outgoing import sends

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        return {name: sends(name) for name in SENT_NAMES}
    finally:
        ps.destroy_model_parallel()


def pipeline_outputs(pp: int, hf_path: str, *extra: str) -> dict[str, torch.Tensor]:
    """PP=``pp`` on ``pp`` ranks: the metrics of both passes (``__old__/``, ``__train__/``), the
    gradients and the updated weights after one optimizer step (``__param__/``), global names."""
    from moe_rl.megatron.hf_weights import hf_names_for
    from moe_rl.trainer.worker import TrainerWorker

    config = recipe(pp, 1, hf_path, pp, "trainer.grad_clip=1.0", *extra)  # clipping: a real grad norm
    worker = TrainerWorker(config)
    batches = global_batch(config)
    batches, old = worker.compute_old_logp(batches)
    step = worker.train_step(batches)
    step = {k: v for k, v in step.items() if k != "train/lr"}
    out = {"__old__/" + k: torch.tensor(v, dtype=torch.float64) for k, v in old.items()}
    out |= {"__train__/" + k: torch.tensor(v, dtype=torch.float64) for k, v in step.items()}
    for name, param in worker.model.named_parameters():
        key = "+".join(hf_names_for(worker.model, name).hf)
        out[key] = param.main_grad.detach().clone()
        out["__param__/" + key] = param.detach().clone()
    return out


def pipeline_rank_main(
    rank: int,
    world: int,
    port: int,
    hf_path: str,
    out_dir: str,
    cases: dict[str, tuple],
    critic: str | None = None,
) -> None:
    """`pipeline_outputs` of PP=``world`` for each of ``cases`` (name -> overrides; one process for
    all: `pp.<name>.<rank>.pt`); for the case named ``critic`` also `critic_outputs` (PPO) of the
    same layout on the whole global batch (`critic.<rank>.pt`); what `outgoing.whole_model` answers
    on a rank of one of the stages (`whole_model.<rank>.pt`: its refusal)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from moe_rl.megatron.parallel import teardown_parallel

    for name, extra in cases.items():
        torch.save(pipeline_outputs(world, hf_path, *extra), Path(out_dir) / f"pp.{name}.{rank}.pt")
        if name == critic:
            config = recipe(world, 1, hf_path, world, *extra, *PPO)
            torch.save(
                critic_outputs(config, list(range(GLOBAL_MICRO_BATCHES))), Path(out_dir) / f"critic.{rank}.pt"
            )
    from moe_rl.weight_sync.outgoing import whole_model

    try:  # a rank of one stage cannot send the whole model (the routes that need it refuse)
        next(whole_model(torch.nn.Linear(1, 1)))
        refused = ""
    except ValueError as e:
        refused = str(e)
    torch.save(refused, Path(out_dir) / f"whole_model.{rank}.pt")
    teardown_parallel()  # a clean exit: no gloo threads left to the interpreter's shutdown
