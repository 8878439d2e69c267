"""The trainer's log-prob passes (`moe_rl.trainer.passes`, as `TrainerWorker` runs them) on packed
micro-batches against plain per-sample forwards, on each device (the model on the process's
device, the micro-batches moved there)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from trainer_testing import micro_batches, run_old_pass, tiny_deepseek, tiny_qwen

from moe_rl.config.modes import ReplayMode
from moe_rl.megatron.model import build_gpt_model
from moe_rl.megatron.replay import RoutingReplay
from moe_rl.trainer import passes
from moe_rl.trainer.logprobs import PassOptions

TEMPERATURE = 0.7
pytestmark = pytest.mark.usefixtures("device")


def _tol(device: torch.device) -> float:
    """Packed vs per-sample forwards: exact up to fp32 rounding on CPU; other kernels on CUDA."""
    return 1e-6 if device.type == "cpu" else 1e-4


def _plain(model, replay, mb):
    """Per sample: a plain forward (routers on their own) -> logits [T, V], routing [T, L, k]."""
    logits, traces = [], []
    cu = mb.micro.cu_seqlens.long().tolist()
    with torch.no_grad():
        for start, end in itertools.pairwise(cu):
            tokens = mb.micro.input_ids[start:end][None]
            positions = torch.arange(end - start, device=tokens.device)[None]
            with replay.record() as rec:
                logits.append(model(tokens, positions, attention_mask=None)[0])
            traces.append(rec.topk_idx_TLK)
    return torch.cat(logits), torch.cat(traces)


def _reference_logp(logits, mb, temperature):
    rows = logits[mb.micro.response_positions - 1] / temperature
    targets = mb.micro.input_ids[mb.micro.response_positions]
    return torch.log_softmax(rows.double(), -1).gather(1, targets[:, None]).squeeze(1)


def _with_trace(mb, trace):
    """``mb`` whose engine routing is ``trace`` (as R3 replays it)."""
    routed = dataclasses.replace(mb.micro, routed_experts=trace.to(mb.micro.routed_experts.dtype))
    return dataclasses.replace(mb, micro=routed)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_zero_update_old_logp_equals_plain_forward(family, device):
    cfg = tiny_qwen() if family == "qwen3_moe" else tiny_deepseek()
    model = build_gpt_model(cfg, seed=11).eval()
    assert next(model.parameters()).device.type == device.type
    replay = RoutingReplay(model)
    options = PassOptions(temperature=TEMPERATURE, chunk_size=5)
    for mb in micro_batches(3, 8, cfg, max_tokens=40, sampling_mask=False, device=device):
        logits, trace = _plain(model, replay, mb)
        reference = _reference_logp(logits, mb, TEMPERATURE)
        [natural], _ = run_old_pass(model, [mb], options)
        [replayed], [found] = run_old_pass(
            model, [_with_trace(mb, trace)], options, ReplayMode.R3, replay, diagnostics=True
        )
        assert natural.old_logp.device.type == device.type
        assert (natural.old_logp.double() - reference).abs().max() <= _tol(device)
        assert (replayed.old_logp.double() - reference).abs().max() <= _tol(device)
        assert float(found["routing_agreement"]) == 1.0  # the routers' own choice is the trace
        # another trace is really replayed: other experts, other log-probs
        [shifted], [moved] = run_old_pass(
            model, [_with_trace(mb, (trace + 1) % cfg.num_experts)], options, ReplayMode.R3, replay,
            diagnostics=True,
        )  # fmt: skip
        assert float(moved["routing_agreement"]) < 1.0
        assert (shifted.old_logp.double() - reference).abs().max() > 1e-3


def test_keep_sampling_mask_and_entropy(device):
    cfg = tiny_qwen()
    model = build_gpt_model(cfg, seed=12).eval()
    replay = RoutingReplay(model)
    options = PassOptions(temperature=TEMPERATURE, chunk_size=4, keep_sampling_mask=True, entropy=True)
    for mb in micro_batches(4, 6, cfg, max_tokens=40, device=device):
        logits, _ = _plain(model, replay, mb)
        [out], _ = run_old_pass(model, [mb], options)
        rows = (logits[mb.micro.response_positions - 1] / TEMPERATURE).double()
        targets = mb.micro.input_ids[mb.micro.response_positions]
        offsets, ids = mb.micro.sampling_mask_offsets, mb.micro.sampling_mask_ids.long()
        for r in range(rows.shape[0]):
            kept = ids[offsets[r] : offsets[r + 1]]
            want = rows[r, targets[r]] - torch.logsumexp(rows[r, kept], 0)
            assert abs(float(out.old_logp[r]) - float(want)) <= _tol(device)
        probs = torch.softmax(rows, -1)
        entropy = -(probs * probs.log()).sum(-1)
        tol = _tol(device)
        torch.testing.assert_close(out.old_entropy.double(), entropy, atol=tol, rtol=tol)


def test_update_pass_logp_has_grad_and_missing_mask_is_an_error(device):
    cfg = tiny_qwen()
    model = build_gpt_model(cfg, seed=13).train()
    mb = micro_batches(5, 4, cfg, sampling_mask=False, device=device)[0]
    ctx = passes.PassContext(None, ReplayMode.OFF, PassOptions(), False, False, lambda mb: None)
    seen = []

    def loss(mb, logp):
        seen.append(logp)
        return logp.sum(), {}

    passes.update_pass(ctx, model, [mb], 0, loss)
    assert seen[0].requires_grad and model.output_layer.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="keep_sampling_mask"):
        run_old_pass(model.eval(), [mb], PassOptions(keep_sampling_mask=True))


def test_padding_to_a_common_length_changes_nothing(device):
    """Expert-parallel ranks pad micro-batches to one length; the real tokens' log-probs stay put."""
    cfg = tiny_qwen()
    model = build_gpt_model(cfg, seed=14).eval()
    replay = RoutingReplay(model)
    mb = micro_batches(6, 5, cfg, device=device)[0]
    options = PassOptions()
    [unpadded], _ = run_old_pass(model, [mb], options, ReplayMode.R3, replay)
    [out], _ = run_old_pass(model, [mb], options, ReplayMode.R3, replay, pad_to=mb.micro.num_tokens + 7)
    tol = 1e-5 if device.type == "cpu" else 1e-4
    torch.testing.assert_close(out.old_logp, unpadded.old_logp, atol=tol, rtol=tol)


def test_a_micro_batch_off_the_model_device_is_refused(device):
    """The worker's boundary moves micro-batches; a pass never moves them itself."""
    from moe_rl.megatron.forward import forward_logits

    cfg = tiny_qwen()
    model = build_gpt_model(cfg, seed=15).eval()
    mb = micro_batches(7, 3, cfg)[0].to("meta")
    with pytest.raises(ValueError, match="input_ids are on meta, the model on"):
        forward_logits(model, mb.micro)
