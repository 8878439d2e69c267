"""Routing replay through Megatron's RouterReplay: forced routing, router gradients (R3),
recording (R2), activation recompute (REPLAY_BACKWARD) and trace validation."""

from __future__ import annotations

import pytest
import torch
from trainer_testing import assert_same, tiny_deepseek, tiny_qwen

from moe_rl.config.schema import TrainerConfig
from moe_rl.megatron.model import build_gpt_model
from moe_rl.megatron.replay import RoutingReplay

SEQ = 12
pytestmark = pytest.mark.usefixtures("device")


def _inputs(device: torch.device, seed: int = 0, vocab: int = 64, seq: int = SEQ):
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seed))
    return tokens.to(device), torch.arange(seq, device=device)[None]


def _forward(model, tokens, positions):
    return model(tokens, positions, attention_mask=None)


def _record(model, replay, tokens, positions):
    with torch.no_grad(), replay.record() as rec:
        out = _forward(model, tokens, positions)
    return out, rec.topk_idx_TLK


def test_record_gives_tokens_layers_k(device):
    model = build_gpt_model(tiny_deepseek(), seed=1).eval()
    replay = RoutingReplay(model)
    _, trace = _record(model, replay, *_inputs(device))
    assert trace.device.type == device.type
    assert trace.shape == (SEQ, 2, 4) and trace.dtype == torch.int64
    assert replay.num_moe_layers == 2 and replay.layer_columns == [0, 1]


def test_replay_forces_routing_after_router_perturbation(device):
    """DeepSeek routing selects with the expert bias but gates without it, so a bias change moves
    only the selection: replaying the old selection restores the old output exactly."""
    model = build_gpt_model(tiny_deepseek(), seed=1).eval()
    replay = RoutingReplay(model)
    tokens, positions = _inputs(device)
    before, trace = _record(model, replay, tokens, positions)
    with torch.no_grad():
        for _, router in replay.routers:
            router.expert_bias.copy_(torch.linspace(-3, 3, router.expert_bias.numel(), device=device))
        natural = _forward(model, tokens, positions)
        with replay.replay(trace):
            replayed = _forward(model, tokens, positions)
    assert not torch.allclose(natural, before, atol=1e-3)
    assert_same(replayed, before, device)


def test_replay_sets_the_routing_map_on_a_softmax_router(device):
    model = build_gpt_model(tiny_qwen(), seed=2).eval()
    replay = RoutingReplay(model)
    tokens, positions = _inputs(device, 1)
    _, trace = _record(model, replay, tokens, positions)
    target = torch.roll(trace, shifts=1, dims=-1)  # same sets
    target[::2] = (target[::2] + 1) % 4  # other sets on every other token
    maps = []
    hooks = [r.register_forward_hook(lambda m, a, o: maps.append(o[1])) for _, r in replay.routers]
    with torch.no_grad(), replay.replay(target), replay.natural_routing() as natural:
        _forward(model, tokens, positions)
    for h in hooks:
        h.remove()
    for layer, routing_map in enumerate(maps):
        want = torch.zeros(SEQ, 4, dtype=torch.bool, device=device).scatter_(1, target[:, layer], True)
        assert torch.equal(routing_map, want)
    assert torch.equal(natural.topk_idx_TLK.sort(-1).values, trace.sort(-1).values)


def test_router_gets_gradients_under_replay(device):
    """R3: replayed ids, gate weights from the trainer's own router logits -> router gradients,
    identical to the natural forward's when the natural routing is replayed; and when another
    routing is replayed (every token to experts 0 and 1), the gradients follow it: experts 2 and 3,
    which the natural routing uses, get none, and the routers' gradients change."""
    model = build_gpt_model(tiny_qwen(), seed=3).train()
    replay = RoutingReplay(model)
    tokens, positions = _inputs(device, 2)
    _, trace = _record(model, replay, tokens, positions)
    _forward(model, tokens, positions).square().mean().backward()
    natural = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with replay.replay(trace):
        _forward(model, tokens, positions).square().mean().backward()
    for name, param in model.named_parameters():
        if "router" in name:
            assert param.grad.abs().sum() > 0, name
        atol = 1e-7 if device.type == "cpu" else 1e-6
        torch.testing.assert_close(param.grad, natural[name], atol=atol, rtol=1e-5)
    model.zero_grad()
    forced = torch.tensor([0, 1], device=device).expand_as(trace).clone()
    assert not torch.equal(forced.sort(-1).values, trace.sort(-1).values)
    with replay.replay(forced):
        _forward(model, tokens, positions).square().mean().backward()
    unused = [n for n in natural if ".local_experts.2." in n or ".local_experts.3." in n]
    assert unused and all(natural[n].abs().sum() > 0 for n in unused)  # the natural routing used them
    for name, param in model.named_parameters():
        if name in unused:
            assert param.grad is None or param.grad.abs().sum() == 0, name
        if "router" in name:
            assert param.grad.abs().sum() > 0 and not torch.allclose(param.grad, natural[name]), name


def test_replay_backward_with_activation_recompute_pops_in_forward_order(device):
    plain = build_gpt_model(tiny_qwen(), seed=4).train()
    recompute = build_gpt_model(
        tiny_qwen(), trainer=TrainerConfig(recompute_activations=True), seed=4
    ).train()
    batches = [_inputs(device, s) for s in (5, 6)]
    traces = [torch.randint(0, 4, (SEQ, 2, 1)) for _ in batches]
    traces = [torch.cat([t, (t + 1 + torch.randint(0, 3, t.shape)) % 4], -1).to(device) for t in traces]
    grads = []
    for model in (plain, recompute):
        replay = RoutingReplay(model)
        losses = []
        for (tokens, positions), trace in zip(batches, traces):  # two forwards before any backward
            replay.set_replay(trace)
            losses.append(_forward(model, tokens, positions).square().mean())
        replay.forward_done()
        for loss in losses:
            loss.backward()
        assert all(not inst.replay_backward_list for inst in replay.instances) or model is plain
        replay.clear()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5)
    # Without REPLAY_BACKWARD the recompute of the first micro-batch replays the second's ids.
    recompute.zero_grad()
    replay = RoutingReplay(recompute)
    losses = []
    for (tokens, positions), trace in zip(batches, traces):
        replay.set_replay(trace)
        losses.append(_forward(recompute, tokens, positions).square().mean())
    for loss in losses:
        loss.backward()
    replay.clear()
    assert any(not torch.allclose(p.grad, grads[0][n], atol=1e-6) for n, p in recompute.named_parameters())


def test_r2_local_trace_replays(device):
    model = build_gpt_model(tiny_deepseek(), seed=5).eval()
    replay = RoutingReplay(model)
    tokens, positions = _inputs(device, 3)
    before, trace = _record(model, replay, tokens, positions)
    with torch.no_grad(), replay.replay(trace, local=True):
        assert_same(_forward(model, tokens, positions), before, device)


def test_padding_rows_are_filled(device):
    """A trace shorter than the packed rows: its rows are replayed as they are, and the rows past
    its end (padding) replay experts ``0..k-1``."""
    model = build_gpt_model(tiny_qwen(), seed=6).eval()
    replay = RoutingReplay(model)
    tokens, positions = _inputs(device, 4)
    _, trace = _record(model, replay, tokens, positions)
    maps = []
    hooks = [r.register_forward_hook(lambda m, a, o: maps.append(o[1])) for _, r in replay.routers]
    with torch.no_grad(), replay.replay(trace[:-3], num_tokens=SEQ):
        _forward(model, tokens, positions)
    for h in hooks:
        h.remove()
    k = trace.shape[-1]
    padding = torch.arange(k, device=device).expand(3, k)
    for layer, routing_map in enumerate(maps):
        want = torch.zeros(SEQ, 4, dtype=torch.bool, device=device)
        want.scatter_(1, torch.cat([trace[:-3, layer], padding]), True)
        assert torch.equal(routing_map, want), layer


def test_bad_traces_name_field_and_sample():
    model = build_gpt_model(tiny_qwen(), seed=7)
    replay = RoutingReplay(model)
    owner = torch.tensor([10] * 6 + [11] * 6)
    good = torch.tensor([0, 1]).expand(SEQ, 2, 2).clone()
    with pytest.raises(ValueError, match="3 MoE layers, the model has 2"):
        replay.check_trace(torch.zeros(SEQ, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="top-k 3"):
        replay.check_trace(torch.tensor([0, 1, 2]).expand(SEQ, 2, 3))
    bad = good.clone()
    bad[7, 1, 0] = 4
    with pytest.raises(
        ValueError, match=r"routed_experts \(sample 11, token 7\): layer 1 slot 0 has expert id 4"
    ):
        replay.check_trace(bad, owner)
    dup = good.clone()
    dup[2, 0] = torch.tensor([3, 3])
    with pytest.raises(ValueError, match=r"sample 10, token 2.*repeats an expert id"):
        replay.check_trace(dup, owner)
    with pytest.raises(ValueError, match="tokens, moe_layers, k"):
        replay.check_trace(torch.zeros(SEQ, 2, dtype=torch.long))


def test_router_fusion_is_refused():
    model = build_gpt_model(tiny_qwen(), trainer=TrainerConfig(moe_router_fusion=True), seed=8)
    with pytest.raises(ValueError, match="moe_router_fusion"):
        RoutingReplay(model)


def test_replay_is_per_model():
    a, b = build_gpt_model(tiny_qwen(), seed=9), build_gpt_model(tiny_qwen(), seed=9)
    ra, rb = RoutingReplay(a), RoutingReplay(b)
    assert not set(map(id, ra.instances)) & set(map(id, rb.instances))
    with ra.replay(torch.tensor([0, 1]).expand(SEQ, 2, 2)):
        assert all(inst.router_replay_action is None for inst in rb.instances)
