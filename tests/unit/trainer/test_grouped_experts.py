"""`trainer.expert_gemm=torch` (`GroupedExperts`) against Megatron's `SequentialMLP`: the same
parameters under the same names, the same logits and the same gradients, with the routers' own
routing and under R3 replay of another routing; the grouped kernel itself (`torch._grouped_mm`)
against the per-expert products. Expert parallelism 2: tests/distributed/test_trainer_dp.py."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from trainer_testing import assert_same, tiny_deepseek, tiny_qwen

from moe_rl.config.modes import ExpertGemm
from moe_rl.config.schema import TrainerConfig
from moe_rl.megatron.grouped_experts import GroupedExperts, grouped_mm_runs
from moe_rl.megatron.model import build_gpt_model
from moe_rl.megatron.replay import RoutingReplay

pytestmark = pytest.mark.usefixtures("device")
SEQ = 24


def _models(family, device):
    config = tiny_qwen() if family == "qwen3_moe" else tiny_deepseek()
    built = {
        gemm: build_gpt_model(config, trainer=TrainerConfig(expert_gemm=gemm), seed=5)
        for gemm in (ExpertGemm.SEQUENTIAL, ExpertGemm.TORCH)
    }
    return built[ExpertGemm.SEQUENTIAL], built[ExpertGemm.TORCH]


def _experts(model) -> list:
    return [m for m in model.modules() if isinstance(m, SequentialMLP)]


def _step(model, device, trace=None):
    """Logits and every parameter's gradient of one forward and backward (``trace``: replayed)."""
    tokens = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(7)).to(device)
    positions = torch.arange(SEQ, device=device)[None]
    model.zero_grad(set_to_none=True)
    replay = RoutingReplay(model)
    if trace is None:
        logits = model(tokens, positions, attention_mask=None)
    else:
        with replay.replay(trace):
            logits = model(tokens, positions, attention_mask=None)
    (logits.float().square().mean() + logits.float()[..., 3].sum()).backward()
    return logits.detach(), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_grouped_experts_equal_sequential_mlp(family, device):
    sequential, grouped = _models(family, device)
    assert all(type(m) is SequentialMLP for m in _experts(sequential))
    assert _experts(grouped) and all(type(m) is GroupedExperts for m in _experts(grouped))
    # the same parameters under the same names: checkpoints, HF names and weight sync see one model
    assert [(n, p.shape) for n, p in sequential.named_parameters()] == [
        (n, p.shape) for n, p in grouped.named_parameters()
    ]
    assert all(torch.equal(a, b) for a, b in zip(sequential.parameters(), grouped.parameters(), strict=True))

    logits, grads = _step(sequential, device)
    got_logits, got_grads = _step(grouped, device)
    assert_same(got_logits, logits, device)
    assert set(got_grads) == set(grads) and any(".local_experts." in n for n in grads)
    for name, grad in grads.items():
        assert_same(got_grads[name], grad, device)
    kernels = {m.kernel for m in _experts(grouped)}
    expected = (
        "grouped_mm" if grouped_mm_runs(device, next(grouped.parameters()).dtype, 32, 32, 16) else "loop"
    )
    assert kernels == {expected}


def test_grouped_experts_in_bf16(device):
    """bf16, as a GPU trains: on CUDA with compute capability 9.0+ the products are
    `torch._grouped_mm`'s (within bf16 rounding of SequentialMLP's), elsewhere the exact loop."""
    config, models = tiny_qwen(), {}
    for gemm in (ExpertGemm.SEQUENTIAL, ExpertGemm.TORCH):
        trainer = TrainerConfig(expert_gemm=gemm, precision="bf16")
        models[gemm] = build_gpt_model(config, trainer=trainer, seed=5)
    logits, grads = _step(models[ExpertGemm.SEQUENTIAL], device)
    got_logits, got_grads = _step(models[ExpertGemm.TORCH], device)
    grouped = grouped_mm_runs(device, torch.bfloat16, 32, 32, 16)
    assert {m.kernel for m in _experts(models[ExpertGemm.TORCH])} == {"grouped_mm" if grouped else "loop"}
    if not grouped:
        assert_same(got_logits, logits, device)
    torch.testing.assert_close(got_logits.float(), logits.float(), rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name].float(), grad.float(), rtol=5e-2, atol=5e-2, msg=name)


def test_grouped_experts_follow_a_replayed_routing(device):
    """R3: both replay the same foreign routing (every token to experts 0 and 1) and agree; the
    replayed routing is really used (experts 2 and 3 get no gradient)."""
    sequential, grouped = _models("qwen3_moe", device)
    trace = torch.zeros(SEQ, 2, 2, dtype=torch.int64, device=device)
    trace[..., 1] = 1
    logits, grads = _step(sequential, device, trace)
    got_logits, got_grads = _step(grouped, device, trace)
    assert_same(got_logits, logits, device)
    for name, grad in grads.items():
        assert_same(got_grads[name], grad, device)
    unused = [g for n, g in got_grads.items() if ".local_experts.2." in n or ".local_experts.3." in n]
    used = [g for n, g in got_grads.items() if ".local_experts.0." in n]
    assert unused and all(float(g.abs().sum()) == 0 for g in unused)
    assert used and all(float(g.abs().sum()) > 0 for g in used)


def test_the_grouped_kernel_equals_per_expert_products(device):
    """`torch._grouped_mm` over stacked weights (fp32; the CPU runs it too when no expert is empty)
    gives the per-expert products' outputs and gradients."""
    _, grouped = _models("qwen3_moe", device)
    layer = _experts(grouped)[0]
    experts = list(layer.local_experts)
    counts = torch.tensor([5, 3, 7, 9])
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(int(counts.sum()), 32, generator=generator).to(device)
    probs = torch.rand(int(counts.sum()), generator=generator).to(device)

    def run(kernel):
        for p in layer.parameters():
            p.grad = None
        x = hidden.clone().requires_grad_()
        out = kernel(x, counts, probs, experts)
        out.square().sum().backward()
        return out.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]

    out, x_grad, grads = run(layer._loop)
    got, got_x_grad, got_grads = run(layer._grouped)
    torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_x_grad, x_grad, rtol=1e-5, atol=1e-6)
    for got_grad, grad in zip(got_grads, grads, strict=True):
        torch.testing.assert_close(got_grad, grad, rtol=1e-5, atol=1e-6)


def test_te_without_transformer_engine_is_refused_naming_the_key():
    from moe_rl.megatron.compat import expert_gemm, te_available

    if te_available():
        pytest.skip("transformer-engine is installed here")
    assert expert_gemm(ExpertGemm.AUTO) == ExpertGemm.TORCH
    with pytest.raises(ValueError, match=r"^trainer.expert_gemm=te: transformer-engine's grouped GEMM needs"):
        expert_gemm(ExpertGemm.TE)


def test_a_converted_or_hooked_expert_linear_runs_its_own_forward(device):
    """ModelOpt's quantization swaps a linear's class and calibration hooks it (before or after
    its forward): the grouped products would skip what that forward adds, so
    `SequentialMLP.forward` runs instead."""
    sequential, grouped = _models("qwen3_moe", device)
    layer = _experts(grouped)[0]

    def double_output(module, args, out):
        return out[0] * 2, out[1]

    def halve_input(module, args):
        return (args[0] / 2,)

    for register, hook in (
        ("register_forward_hook", double_output),
        ("register_forward_pre_hook", halve_input),
    ):
        handles = [
            getattr(_experts(m)[0].local_experts[1].linear_fc2, register)(hook) for m in (grouped, sequential)
        ]
        logits, _ = _step(grouped, device)
        assert layer.kernel is None
        assert_same(logits, _step(sequential, device)[0], device)  # the hook's effect is in both
        for handle in handles:
            handle.remove()
        _step(grouped, device)
        assert layer.kernel in ("loop", "grouped_mm")
    fc1 = layer.local_experts[0].linear_fc1
    fc1.__class__ = type("Converted", (type(fc1),), {})
    _step(grouped, device)
    assert layer.kernel is None


def test_grouped_experts_with_lora_adapters_equal_sequential_mlp(device):
    """LoRA on every expert (`moe_rl.megatron.lora`): the grouped path adds each expert's ``s·B·A·x``
    (on a GPU as two more grouped products of the stacked factors, `_grouped_product`; on the CPU in
    its loop) and gives `SequentialMLP`'s logits and gradients, the adapters' included."""
    from moe_rl.config.schema import LoraConfig
    from moe_rl.megatron.lora import adapted_linears, freeze_base

    lora = LoraConfig(rank=4, alpha=8.0)
    config = tiny_qwen()
    sequential, grouped = (
        build_gpt_model(config, trainer=TrainerConfig(expert_gemm=gemm), seed=5, lora=lora)
        for gemm in (ExpertGemm.SEQUENTIAL, ExpertGemm.TORCH)
    )
    seeded = torch.Generator().manual_seed(3)
    for model in (sequential, grouped):
        freeze_base(model, lora)
    with torch.no_grad():
        for (name, a), (_, b) in zip(
            adapted_linears(sequential).items(), adapted_linears(grouped).items(), strict=True
        ):
            assert ".local_experts." in name or "self_attention" in name
            a.lora_b.copy_(torch.randn(a.lora_b.shape, generator=seeded).to(a.lora_b) * 0.1)
            b.lora_b.copy_(a.lora_b)
            b.lora_a.copy_(a.lora_a)
    logits, grads = _step(sequential, device)
    got_logits, got_grads = _step(grouped, device)
    assert_same(got_logits, logits, device)
    assert set(got_grads) == set(grads) and any(
        ".local_experts." in n and n.endswith("lora_b") for n in grads
    )
    for name, grad in grads.items():
        assert_same(got_grads[name], grad, device)
