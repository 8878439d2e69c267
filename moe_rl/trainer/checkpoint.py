"""A trainer rank's checkpoint: model, optimizer, schedule, RNG, step and, with a KL penalty, the
reference policy, with a critic its weights, optimizer, schedule and step (``critic.`` keys), through Megatron ``dist_checkpointing`` (every rank writes and reads its own
shards; any trainer layout reads any other's).

The reference policy is saved next to the policy (``reference.`` keys), so a resumed run keeps the
original run's starting weights whatever seed or HF path it starts from; a checkpoint saved without
a KL penalty holds none, and the reference stays the starting weights the worker built.
"""

from __future__ import annotations

import logging
import queue
import random
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.errors import UserError
from moe_rl.megatron.lora import is_adapter
from moe_rl.trainer.critic import PREFIX as CRITIC_PREFIX
from moe_rl.trainer.critic import saved_with_critic
from moe_rl.trainer.reference import PREFIX as REFERENCE_PREFIX
from moe_rl.trainer.reference import saved_with_reference

log = logging.getLogger("moe_rl.trainer.worker")


def rng_state(device: torch.device) -> dict:
    """Python, NumPy and torch RNG states (and CUDA's, with Megatron's tracker, on a GPU)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def _sharded_state(worker, is_loading: bool, reference: bool = True, critic: bool = True) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_sd = worker.model.sharded_state_dict()
    rank, world = dist.get_rank(), dist.get_world_size()
    state = {
        "model": model_sd,
        "optimizer": worker.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        "scheduler": worker.scheduler.state_dict(),
        "step": worker.step,
        "rng": ShardedObject("rng_state", rng_state(worker.device), (world,), (rank,), replica_id=0),
    }
    if reference and worker.reference is not None:
        state["reference"] = worker.reference.sharded_state_dict()
    if critic and worker.critic is not None:
        state["critic"] = worker.critic.sharded_state_dict(is_loading)
    return state


def _reference_resident(worker) -> AbstractContextManager:
    """The reference's weights on the device for a checkpoint's save or load (when offloaded)."""
    return worker.reference.resident() if worker.reference is not None else nullcontext()


@contextmanager
def _write_results_in_process() -> Iterator[None]:
    """Megatron's checkpoint writer hands its write results to the caller through a queue served by
    a process it spawns once per process (``filesystem_async._get_write_results_queue``), made for
    saves that finish in a background process. This project's saves are synchronous: the results
    are put and read in this process, so a plain queue holds them, and no helper process starts
    (that process imports torch to unpickle the first results: about 2.5 s on each run's first
    checkpoint). Where Megatron keeps no such queue, its own is used."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    held = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = held


def save(worker, directory: str | Path) -> Path:
    """Save ``worker``'s state (see the module docstring) into ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with _reference_resident(worker), _write_results_in_process():
        dist_checkpointing.save(_sharded_state(worker, is_loading=False), str(directory))
    log.info("saved checkpoint of step %d to %s", worker.step, directory)
    return directory


RESUMED = "the resumed run (its config.yaml and the overrides given; a run resumes with its own model)"
"""Whose model a resumed checkpoint must fit (`load`)."""


def load(worker, directory: str | Path) -> int:
    """Restore everything `save` wrote into ``worker``; returns the step (collective). A checkpoint
    that does not fit the model (`check_fit`) is one error naming the tensors."""
    from megatron.core import dist_checkpointing

    check_fit(worker.model, Path(directory), RESUMED)
    with_reference = worker.reference is not None and saved_with_reference(directory)
    if worker.reference is not None and not with_reference:
        log.warning(
            "checkpoint %s holds no reference policy (saved with algo.kl.coef=0): the reference is "
            "the starting weights of this run's model.hf_path or run.seed", directory,
        )  # fmt: skip
    with_critic = worker.critic is not None and saved_with_critic(directory)
    if worker.critic is not None and not with_critic:
        log.warning(
            "checkpoint %s holds no critic (saved by a run without one): the critic starts afresh "
            "(critic.init=%s)", directory, worker.config.critic.init,
        )  # fmt: skip
    with _reference_resident(worker):
        state = dist_checkpointing.load(
            _sharded_state(worker, True, with_reference, with_critic), str(directory)
        )
        if with_reference:
            worker.reference.load_sharded(state["reference"])
        if with_critic:
            worker.critic.load_sharded(state["critic"])
    worker.model.load_state_dict(state["model"])
    worker.optimizer.load_state_dict(state["optimizer"])
    worker.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"], worker.device)
    worker.step = int(state["step"])
    log.info("loaded checkpoint of step %d from %s", worker.step, directory)
    return worker.step


def load_start_weights(model, config) -> None:
    """The policy's starting weights into ``model``, built with the recipe's seed: a Hugging Face
    checkpoint (``model.hf_path``), then a run's checkpoint (``model.init_from``, e.g. an SFT run's
    newest). The one home of this rule: the trainer starts from them, and `moe-rl diagnose` measures
    the mismatch at them."""
    from moe_rl.megatron.hf_weights import load_hf_checkpoint
    from moe_rl.run_dir import init_checkpoint

    if config.model.hf_path:
        load_hf_checkpoint(model, config.model.hf_path)
    if config.model.init_from:
        trainer_dir = init_checkpoint(Path(config.model.init_from))
        whose = f"model.init_from={config.model.init_from}"
        load_model_weights(model, trainer_dir, whose, start=builder(config.model, config))
        log.info("starting from the weights of %s", trainer_dir.parent)


def builder(model_config, config):
    """How to build a model of ``model_config`` in ``config``'s layout and seed, with given LoRA
    settings (`load_model_weights`' ``start``)."""
    from moe_rl.megatron.model import build_gpt_model

    def build(lora):
        return build_gpt_model(model_config, config.parallel, config.trainer, seed=config.run.seed, lora=lora)

    return build


def load_model_weights(model, trainer_dir: Path, whose: str = "the run's config.yaml", start=None) -> None:
    """The policy's weights from a trainer checkpoint into ``model`` (the optimizer state and a
    reference policy's ``reference.`` keys stay unread; Megatron's dist_checkpointing reshards what
    any layout wrote); a checkpoint that does not fit the model (`check_fit`) is one error naming
    ``whose`` model it is. A model with LoRA adapters takes a full-weight checkpoint's weights as its
    base and keeps its fresh adapters.

    ``start`` (`builder`): the weights are where a new run starts (``model.init_from``,
    ``critic.init_from``, ``teacher.path``). A LoRA run's checkpoint then gives its policy as it
    computes, each adapter merged (`_load_merged`): the weights of a full-weight model, or the base
    of a LoRA model, whose adapters stay fresh (so its reference policy is that start too)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    if start is not None and any(is_adapter(key) for key in _held_shapes(trainer_dir)):
        _load_merged(model, trainer_dir, whose, start)
        return
    misfit = f"checkpoint {trainer_dir} does not fit the model of {whose}"
    with_adapters = check_fit(model, trainer_dir, whose)
    request = model.sharded_state_dict()
    if not with_adapters:
        request = {k: v for k, v in request.items() if not is_adapter(k)}
    try:
        state = dist_checkpointing.load({"model": request}, str(trainer_dir))
    except (CheckpointException, CheckpointingException) as exc:
        causes = [f[0] for f in exc.failures.values()] if isinstance(exc, CheckpointException) else [exc]
        mismatch = next((c for c in causes if isinstance(c, CheckpointingException)), None)
        if mismatch is None:
            raise
        raise UserError(f"{misfit}: {mismatch}") from exc
    model.load_state_dict(state["model"], strict=with_adapters)


def critic_start(config, policy):
    """The policy-shaped model whose body a critic starts from (``critic.init``): the policy with
    its starting weights (`policy`), a model holding the policy weights of the trainer checkpoint
    ``critic.init_from`` names (`checkpoint`), or None (`config`: the critic's own initialization)."""
    from moe_rl.config.modes import CriticInit
    from moe_rl.megatron.model import build_gpt_model
    from moe_rl.run_dir import init_checkpoint

    critic = config.critic
    if critic.init == CriticInit.POLICY:
        return policy
    if critic.init == CriticInit.CONFIG:
        return None
    key = f"critic.init_from={critic.init_from}"
    trainer_dir = init_checkpoint(Path(critic.init_from), key=key)
    model = build_gpt_model(config.model, config.parallel, config.trainer, seed=config.run.seed)
    load_model_weights(model, trainer_dir, key, start=builder(config.model, config))
    log.info("the critic starts from the weights of %s", trainer_dir.parent)
    return model


NOT_POLICY = ("optimizer.", REFERENCE_PREFIX, CRITIC_PREFIX)
"""Keys of a trainer checkpoint's tensors that are not the policy's."""


def check_fit(model, trainer_dir: Path, whose: str) -> bool:
    """Raise one `UserError` when the checkpoint in ``trainer_dir`` does not fit ``model`` (the
    policy of ``whose`` recipe), from the checkpoint's metadata, before anything is read: tensors of
    another shape (a changed ``model.*`` size), tensors it lacks or only it holds (a changed layer
    or expert count); each named by its key, with the two shapes. LoRA: a model with adapters fits
    a checkpoint without them (its base; the return value False: the adapters are not read); a
    checkpoint with adapters fits only a model with the same ones (a run that starts from it takes
    its merged weights instead: `load_model_weights` with ``start``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    request = model.sharded_state_dict()
    apply_factories(request)
    wanted = {t.key: tuple(t.global_shape) for t in nested_values(request) if isinstance(t, ShardedTensor)}
    held = _held_shapes(trainer_dir)
    shapes = [
        f"{k}: {held[k]} in the checkpoint, {wanted[k]} in the model"
        for k in sorted(wanted.keys() & held.keys())
        if held[k] != wanted[k]
    ]
    with_adapters = any(is_adapter(k) for k in held)
    if any(is_adapter(k) for k in wanted) and not with_adapters:
        wanted = {k: v for k, v in wanted.items() if not is_adapter(k)}
    elif with_adapters and not any(is_adapter(k) for k in wanted):
        raise UserError(
            f"checkpoint {trainer_dir} holds LoRA adapters and the model of {whose} has none: export the "
            "run's merged weights (`moe-rl export RUN DIR`) and load them with model.hf_path=DIR"
        )
    absent, extra = sorted(wanted.keys() - held.keys()), sorted(held.keys() - wanted.keys())
    problems = [
        f"{len(found)} {what}, e.g. {'; '.join(found[:2])}"
        for found, what in ((shapes, "tensors of another shape"), (absent, "of the model's tensors missing"),
                            (extra, "tensors the model lacks"))
        if found
    ]  # fmt: skip
    if problems:
        raise UserError(f"checkpoint {trainer_dir} does not fit the model of {whose}: {'; '.join(problems)}")
    return with_adapters


def _held_shapes(trainer_dir: Path) -> dict[str, tuple[int, ...]]:
    """The policy's tensors in a trainer checkpoint's metadata: key -> global shape."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return {
        key: tuple(meta.global_shape)
        for key, meta in load_tensors_metadata(str(trainer_dir)).items()
        if not key.startswith(NOT_POLICY)
    }


def _load_merged(model, trainer_dir: Path, whose: str, start) -> None:
    """A LoRA checkpoint's policy, each adapter merged into its weight (``W + s·B·A``), into
    ``model``'s weights; ``model``'s own adapters (if any) keep their fresh values. The adapters'
    settings (rank, scale, targets) are those of the checkpoint's run (its ``config.yaml``): a model
    ``start(lora)`` builds in this layout holds the checkpoint as it is, then gives its merged weights."""
    from moe_rl.config import load_recipe
    from moe_rl.megatron.hf_weights import merged_tensor

    recipe = trainer_dir.parent.parent.parent / "config.yaml"  # <run>/checkpoints/step_N/trainer
    if not recipe.is_file():
        raise UserError(
            f"{whose}: checkpoint {trainer_dir} holds LoRA adapters, and their settings (lora.rank, "
            f"lora.alpha) are in its run's config.yaml, which is not at {recipe}"
        )
    source = start(load_recipe(recipe).lora)
    load_model_weights(source, trainer_dir, whose)  # the adapters as they are
    merged = {}
    with torch.no_grad():
        for name, tensor in source.state_dict().items():
            if is_adapter(name) or not isinstance(tensor, torch.Tensor):
                continue
            merged[name] = merged_tensor(source, name, tensor)
    missing, unexpected = model.load_state_dict(merged, strict=False)
    left = [key for key in missing if not is_adapter(key) and not key.endswith("_extra_state")]
    if left or unexpected:
        raise UserError(
            f"checkpoint {trainer_dir} does not fit the model of {whose}: "
            f"missing {left[:3]}, the model lacks {list(unexpected)[:3]}"
        )
    del source
    log.info(
        "LoRA checkpoint %s: starting from its merged weights (each adapter added to its weight)", trainer_dir
    )
