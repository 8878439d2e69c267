"""LoRA in the trainer (`moe_rl.megatron.lora`): adapters on attention and every expert, the policy's
weights frozen (no gradient buffer, no optimizer state), a fresh adapter that changes nothing, the
merged weights the sync and the export send computing what the adapted model computes, the grouped
expert path equal to Megatron's own, and the adapters through a checkpoint."""

from __future__ import annotations

import pytest
import torch
from trainer_testing import micro_batches, tiny_recipe

from moe_rl.megatron.hf_weights import iter_hf_weights, load_hf_weights
from moe_rl.megatron.lora import adapted_linears, is_adapter
from moe_rl.megatron.model import build_gpt_model
from moe_rl.trainer.worker import TrainerWorker

LORA = ("lora.rank=4", "lora.alpha=8")


def _batches(config, seed: int = 0):
    return micro_batches(seed, 12, config.model, max_tokens=48)


def _base_of(worker: TrainerWorker) -> dict[str, torch.Tensor]:
    state = worker.model.state_dict()
    return {
        k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor) and not is_adapter(k)
    }


def _logits(model, mb) -> torch.Tensor:
    from moe_rl.megatron.forward import packed_seq_params, pad_micro_batch

    tokens, positions, cu = pad_micro_batch(mb.micro, None)
    with torch.no_grad():
        return model(
            tokens[None], positions[None], attention_mask=None, packed_seq_params=packed_seq_params(cu)
        )


@pytest.fixture(scope="module")
def pair():
    """A full-weight worker and a LoRA worker holding the same starting weights."""
    full = TrainerWorker(tiny_recipe())
    lora = TrainerWorker(tiny_recipe(*LORA))
    missing, unexpected = lora.model.load_state_dict(_base_of(full), strict=False)
    assert not unexpected and missing and all(is_adapter(k) for k in missing)
    return full, lora


def test_adapters_sit_on_the_targets_and_only_they_train(pair):
    _, lora = pair
    names = adapted_linears(lora.model)
    layers = lora.config.model.num_layers
    experts = lora.config.model.num_experts
    assert len(names) == layers * (2 + 2 * experts)  # QKV and output, two linears per expert
    trainable = {n for n, p in lora.model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    assert len(trainable) == 2 * len(names)
    # the frozen weights have no gradient buffer and no optimizer state
    assert all(not hasattr(p, "main_grad") for p in lora.model.parameters() if not p.requires_grad)
    optimized = [p for group in lora.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for n, p in lora.model.named_parameters() if is_adapter(n)}
    b = next(m.lora_b for m in names.values())
    assert torch.count_nonzero(b) == 0


def test_a_fresh_adapter_changes_nothing_and_a_step_moves_only_the_adapters(pair):
    full, lora = pair
    mbs = _batches(full.config)
    base_before = _base_of(lora)
    full_old, full_metrics = full.compute_old_logp(mbs)
    lora_old, lora_metrics = lora.compute_old_logp(mbs)
    assert full_metrics == lora_metrics  # the stack's π_old metrics (R3 agreement, KSM, mismatch)
    for a, b in zip(full_old, lora_old, strict=True):
        assert torch.equal(a.old_logp, b.old_logp) and torch.equal(a.advantages, b.advantages)
    full_step, lora_step = full.train_step(full_old), lora.train_step(lora_old)
    assert lora_step["train/update_ok"] == 1.0 and lora_step["train/grad_norm"] > 0
    assert lora_step["train/loss"] == full_step["train/loss"]  # the same forward before the update
    after = _base_of(lora)
    assert all(torch.equal(after[k], v) for k, v in base_before.items())
    moved = [m for m in adapted_linears(lora.model).values() if torch.count_nonzero(m.lora_b) > 0]
    assert moved  # B left zero: the adapters now change the model
    new_old, _ = lora.compute_old_logp(mbs)
    assert any(not torch.equal(a.old_logp, b.old_logp) for a, b in zip(lora_old, new_old, strict=True))


def test_the_merged_weights_compute_what_the_adapted_model_computes(pair):
    _, lora = pair
    for module in adapted_linears(lora.model).values():  # every adapter non-zero, A and B
        with torch.no_grad():
            module.lora_b.normal_(0.0, 0.05)
    exported = dict(iter_hf_weights(lora.model))
    assert not any("lora" in name for name in exported)
    merged = build_gpt_model(lora.config.model, lora.config.parallel, lora.config.trainer, seed=3)
    load_hf_weights(merged, exported)
    some = next(iter(adapted_linears(lora.model).items()))
    name, module = some
    assert not torch.equal(merged.get_submodule(name).weight, module.weight)  # merged, not the base
    lora.model.eval()
    for mb in _batches(lora.config, seed=1)[:2]:
        torch.testing.assert_close(_logits(merged, mb), _logits(lora.model, mb), rtol=1e-5, atol=1e-5)


def test_the_grouped_expert_path_adds_each_experts_adapter():
    """`GroupedExperts` (the CPU default) against Megatron's `SequentialMLP`, both with adapters:
    the same logits and the same adapter gradients."""
    grouped = TrainerWorker(tiny_recipe(*LORA, "trainer.expert_gemm=torch"))
    sequential = TrainerWorker(tiny_recipe(*LORA, "trainer.expert_gemm=sequential"))
    sequential.model.load_state_dict(grouped.model.state_dict())
    for name, module in adapted_linears(grouped.model).items():
        with torch.no_grad():
            module.lora_b.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(hash(name) % 1000))
            sequential.model.get_submodule(name).lora_b.copy_(module.lora_b)
    mbs = _batches(grouped.config, seed=2)
    for worker in (grouped, sequential):
        worker.model.eval()
    torch.testing.assert_close(_logits(grouped.model, mbs[0]), _logits(sequential.model, mbs[0]))
    g_old, _ = grouped.compute_old_logp(mbs)
    s_old, _ = sequential.compute_old_logp(mbs)
    grouped.train_step(g_old)
    sequential.train_step(s_old)
    experts = {n: p for n, p in grouped.model.named_parameters() if is_adapter(n) and "local_experts" in n}
    assert experts
    other = dict(sequential.model.named_parameters())
    for name, param in experts.items():
        torch.testing.assert_close(param, other[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_adapters_go_through_a_checkpoint(tmp_path):
    """After a step (``B`` starts at 0), every adapter comes back from the checkpoint into a worker of
    another seed. Its own worker: the module's pair may not have stepped in this process."""
    lora = TrainerWorker(tiny_recipe(*LORA))
    assert lora.train_step(lora.compute_old_logp(_batches(lora.config))[0])["train/update_ok"] == 1.0
    saved = {k: v.detach().clone() for k, v in lora.model.state_dict().items() if is_adapter(k)}
    assert any(torch.count_nonzero(v) for k, v in saved.items() if k.endswith("lora_b"))
    lora.save_checkpoint(tmp_path / "trainer")
    fresh = TrainerWorker(tiny_recipe(*LORA, "run.seed=9"))
    fresh.load_checkpoint(tmp_path / "trainer")
    got = fresh.model.state_dict()
    for key, value in saved.items():
        assert torch.equal(got[key], value), key


def test_the_engine_samples_from_the_merged_policy_step_after_step():
    """The in-process loop of `moe-rl train` (trainer, Megatron engine, the sync between) with LoRA:
    after each step the engine holds the merged weights, so its log-probs are the trainer's (bf16
    rollouts: no quantization between them) while the adapters move and the base stays."""
    from moe_rl.orchestration.local import LocalRun
    from moe_rl.orchestration.preflight import load_checked
    from tests.unit.trainer.trainer_testing import TINY_MODEL_OVERRIDES, TINY_RECIPE

    config = load_checked(
        TINY_RECIPE,
        [*TINY_MODEL_OVERRIDES, *LORA, "rollout.quant=bf16", "rollout.batch_size=16", "rollout.group_size=4"],
    )
    run = LocalRun(config)
    model = run.trainer.model
    base = {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and not is_adapter(k)
    }
    records = list(run.run(3))
    assert all(r["old/prob_abs_diff_max"] < 1e-5 for r in records), [
        r["old/prob_abs_diff_max"] for r in records
    ]
    assert any(r["train/grad_norm"] > 0 for r in records)
    assert any(torch.count_nonzero(m.lora_b) for m in adapted_linears(model).values())
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())


@pytest.mark.parametrize(
    ("family", "head"), [("qwen3_moe", "false"), ("qwen3_moe", "true"), ("deepseek_v3", "true")]
)
def test_the_planners_count_is_the_built_models(family, head):
    """`lora_param_counts` (what `moe-rl plan` sizes a LoRA run's gradients and Adam state by) equals
    the trainable elements of the model the trainer builds: MLA, a dense first layer, shared experts."""
    import dataclasses

    from trainer_testing import tiny_deepseek

    from moe_rl.megatron.lora import freeze_base
    from moe_rl.planner.flops import lora_param_counts

    config = tiny_recipe(*LORA, "lora.train_router=true", f"lora.train_output_layer={head}")
    if family == "deepseek_v3":
        config = dataclasses.replace(config, model=tiny_deepseek())
    model = build_gpt_model(config.model, config.parallel, config.trainer, seed=1, lora=config.lora)
    trainable = freeze_base(model, config.lora)
    assert trainable == lora_param_counts(config.model, config.lora).total
    head_params = config.model.vocab_size * config.model.hidden_size
    assert model.output_layer.weight.requires_grad == (head == "true")
    assert (trainable > head_params) and (head == "false" or trainable - head_params > 0)


def _run_dir(tmp_path, worker: TrainerWorker, name: str):
    """A run directory holding one sealed checkpoint of ``worker`` and its config."""
    from moe_rl.config.loader import to_yaml
    from moe_rl.run_dir import write_manifest

    run = tmp_path / name
    checkpoint = run / "checkpoints" / "step_000000"
    worker.save_checkpoint(checkpoint / "trainer")
    write_manifest(checkpoint)
    (run / "config.yaml").write_text(to_yaml(worker.config))
    return run


def test_a_lora_run_starts_from_a_full_runs_weights_and_exports_its_merged_policy(pair, tmp_path):
    """`model.init_from` a full-weight run: its weights are the base, the adapters fresh. `moe-rl
    export` of a LoRA run writes the merged weights; a full-weight model does not take a LoRA
    checkpoint as it is (naming the export), but a run that starts from one takes its merged
    weights."""
    from safetensors.torch import load_file

    from launch.export import _write_weights
    from moe_rl.config.modes import LoraExport
    from moe_rl.errors import UserError
    from moe_rl.megatron.parallel import init_parallel
    from moe_rl.trainer.checkpoint import load_model_weights

    full, lora = pair
    source = _run_dir(tmp_path, full, "full")
    started = TrainerWorker(tiny_recipe(*LORA, f"model.init_from={source}", "run.seed=7"))
    base = _base_of(full)
    got = started.model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in base.items())
    assert all(torch.count_nonzero(m.lora_b) == 0 for m in adapted_linears(started.model).values())

    for module in adapted_linears(lora.model).values():
        with torch.no_grad():
            module.lora_b.normal_(0.0, 0.05)
    adapted = _run_dir(tmp_path, lora, "lora")
    merged = dict(iter_hf_weights(lora.model))
    trainer_dir = adapted / "checkpoints" / "step_000000" / "trainer"
    _write_weights(lora.config, trainer_dir, tmp_path / "export", 1 << 30, LoraExport.MERGED)
    init_parallel(lora.config.parallel)  # the export tears its one-rank groups down
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(exported) == set(merged) and all(torch.equal(exported[n], merged[n]) for n in merged)
    with pytest.raises(UserError, match="holds LoRA adapters.*model.hf_path"):
        load_model_weights(
            build_gpt_model(full.config.model, full.config.parallel, full.config.trainer), trainer_dir
        )

    # `--init-from` the LoRA run: its merged policy, as a full-weight run's weights or a new LoRA
    # run's base (other rank and scale: the source's own come from its config.yaml), adapters fresh
    for recipe in ([], ["lora.rank=8", "lora.alpha=32"]):
        warm = TrainerWorker(tiny_recipe(*recipe, f"model.init_from={adapted}", "run.seed=7"))
        assert all(torch.count_nonzero(m.lora_b) == 0 for m in adapted_linears(warm.model).values())
        started = dict(iter_hf_weights(warm.model))
        assert set(started) == set(merged) and all(torch.equal(started[n], merged[n]) for n in merged), recipe
    (adapted / "config.yaml").unlink()
    with pytest.raises(UserError, match="settings \\(lora.rank, lora.alpha\\) are in its run's config.yaml"):
        TrainerWorker(tiny_recipe(f"model.init_from={adapted}"))


def test_an_adapter_adds_alpha_over_rank_times_b_a_x_by_hand(pair):
    """rank 4, alpha 8: s = 2. With A and B set by hand, one adapted linear's output is W·x + 2·B·A·x,
    and its merged weight W + 2·B·A (the sync's and the export's)."""
    _, lora = pair
    module = next(iter(adapted_linears(lora.model).values()))
    assert module.lora_scale == 2.0
    a = torch.arange(module.lora_a.numel(), dtype=torch.float32).reshape(module.lora_a.shape) / 100.0
    b = torch.ones_like(module.lora_b) * 0.5
    x = torch.linspace(-1.0, 1.0, module.lora_a.shape[1]).reshape(1, 1, -1)
    before = (module.lora_a.detach().clone(), module.lora_b.detach().clone())
    try:
        with torch.no_grad():
            module.lora_a.copy_(a)
            module.lora_b.copy_(b)
        module.eval()
        out = module(x)[0]
        expected = x @ module.weight.t() + 2.0 * (x @ a.t()) @ b.t()
        torch.testing.assert_close(out, expected.to(out.dtype), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            module.merged_weight(), (module.weight + 2.0 * b @ a).to(module.weight.dtype)
        )
    finally:
        with torch.no_grad():
            module.lora_a.copy_(before[0])
            module.lora_b.copy_(before[1])


def test_adapter_dropout_acts_in_training_only():
    """lora.dropout=0.5: in training the input of A is dropped at random (two forwards differ); in
    evaluation (the π_old and reference passes, the engine) it is not: output as by hand, every time."""
    worker = TrainerWorker(tiny_recipe(*LORA, "lora.dropout=0.5"))
    module = next(iter(adapted_linears(worker.model).values()))
    with torch.no_grad():
        module.lora_b.normal_(0.0, 0.5)
    x = torch.linspace(-1.0, 1.0, module.lora_a.shape[1]).reshape(1, 1, -1)
    module.train()
    torch.manual_seed(0)
    first = module(x)[0]
    second = module(x)[0]
    assert not torch.equal(first, second)
    module.eval()
    expected = x @ module.weight.t() + module.lora_scale * (x @ module.lora_a.t()) @ module.lora_b.t()
    torch.testing.assert_close(module(x)[0], expected.to(first.dtype), rtol=1e-5, atol=1e-5)
    mbs = _batches(worker.config)
    once, _ = worker.compute_old_logp(mbs)
    again, _ = worker.compute_old_logp(mbs)
    for a, b in zip(once, again, strict=True):
        assert torch.equal(a.old_logp, b.old_logp)  # π_old's pass runs the model in evaluation


@pytest.mark.parametrize("head", ["true", "false"])
def test_with_tied_embeddings_the_trained_output_layer_is_the_shared_embedding(head):
    """``model.tie_word_embeddings=true``: the output layer is the embedding. With
    ``lora.train_output_layer`` that one weight trains (in the optimizer, moved by a step); without,
    it stays frozen like the rest of the base."""
    worker = TrainerWorker(
        tiny_recipe(*LORA, "model.tie_word_embeddings=true", f"lora.train_output_layer={head}")
    )
    model = worker.model
    assert model.share_embeddings_and_output_weights
    embedding = model.embedding.word_embeddings.weight
    assert embedding.requires_grad == (head == "true")
    optimized = {id(p) for group in worker.optimizer.param_groups for p in group["params"]}
    assert (id(embedding) in optimized) == (head == "true")
    before = embedding.detach().clone()
    prepared, _ = worker.compute_old_logp(_batches(worker.config))
    assert worker.train_step(prepared)["train/update_ok"] == 1.0
    assert torch.equal(embedding, before) == (head == "false")


@pytest.mark.parametrize("init", ["gaussian", "kaiming"])
def test_a_starts_as_lora_init_says_and_b_at_zero(init):
    """``lora.init=gaussian``: every ``A`` normal with mean 0 and standard deviation 1/rank;
    ``kaiming`` (the default): uniform in ±1/√in, the linear's whole input width. ``B`` zero."""
    worker = TrainerWorker(tiny_recipe("lora.rank=4", "lora.alpha=8", f"lora.init={init}"))
    linears = adapted_linears(worker.model).values()
    assert all(torch.count_nonzero(m.lora_b) == 0 for m in linears)
    if init == "gaussian":
        a = torch.cat([m.lora_a.detach().float().flatten() for m in linears])
        assert a.numel() >= 2048  # the spread of a sample this size: under 0.004 for its deviation
        assert abs(a.mean().item()) < 0.02 and abs(a.std().item() - 0.25) < 0.0125  # 1 / rank
        return
    for module in linears:
        a = module.lora_a.detach().float()
        bound = 1.0 / a.shape[1] ** 0.5  # one rank: its A reads the whole input
        assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
        assert abs(a.std().item() - bound / 3**0.5) < 0.2 * bound  # uniform's deviation: bound/√3
