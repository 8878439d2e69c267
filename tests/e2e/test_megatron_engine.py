"""The Megatron engine on the tiny MoE, on each device: routing, sampling masks and log-probs agree
with the trainer's passes; a quantized recipe produces a real mismatch; what it returns is a CPU
trajectory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.algo.diagnostics import routing_agreement
from moe_rl.config.modes import ReplayMode
from moe_rl.data.validate import validate
from moe_rl.megatron.hf_weights import iter_hf_weights
from moe_rl.megatron.replay import RoutingReplay
from moe_rl.orchestration.preflight import load_checked
from moe_rl.rollout.engine import SamplingSpec
from moe_rl.rollout.megatron_engine import MegatronEngine
from moe_rl.trainer import passes
from moe_rl.trainer.batch import make_train_micro_batches
from moe_rl.trainer.logprobs import PassOptions

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("device")]

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe.yaml"
VOCAB = load_checked(TINY).model.vocab_size
PROMPTS = [[1, 3 + i, 4 + (i * 3) % 10, 5 + (i * 7) % 8, 2] for i in range(8)]


def make_engine(quant: str) -> MegatronEngine:
    return MegatronEngine(
        load_checked(TINY, [f"rollout.quant={quant}", "rollout.top_p=0.9", "rollout.top_k=8"])
    )


@pytest.fixture(scope="module")
def bf16_engine():
    return make_engine("bf16")


def spec(n=4, seed=0) -> SamplingSpec:
    return SamplingSpec(
        temperature=1.0, top_k=8, top_p=0.9, max_new_tokens=6, n=n, seed=seed, stop_token_ids=(2,)
    )


def trainer_pass(model, batch, keep_sampling_mask=True, trace=True):
    """The trainer's π_old pass (`passes.old_pass`, as `TrainerWorker` runs it) on the engine's own
    batch: recording the routers' choice (R2), then replaying the engine's routing (R3)."""
    (mb,) = make_train_micro_batches(batch, torch.zeros(batch.num_samples), 100_000)
    mb = mb.to(next(model.parameters()).device)
    replay = RoutingReplay(model)
    opts = PassOptions(temperature=1.0, keep_sampling_mask=keep_sampling_mask)

    def run(mode: ReplayMode):
        ctx = passes.PassContext(replay, mode, opts, False, False, lambda mb: None)
        [out], _ = passes.old_pass(ctx, model, [mb], 0, False, passes.shape_zero_variance(0.0))
        return out

    return mb.micro, run(ReplayMode.R2), run(ReplayMode.R3) if trace else None


def test_batch_is_valid_and_every_sampled_token_is_in_its_mask(bf16_engine, device):
    assert bf16_engine.device.type == device.type
    batch = bf16_engine.generate(PROMPTS, spec())
    assert batch.response_ids.device.type == batch.routed_experts.device.type == "cpu"
    validate(batch, vocab_size=VOCAB)  # includes: sampled token in its kept set
    assert batch.num_samples == 32 and batch.engine == "megatron"
    assert batch.group_ids.tolist() == [g for g in range(8) for _ in range(4)]
    kept_sizes = batch.sampling_mask_offsets.diff()
    assert (kept_sizes <= 8).all() and (kept_sizes >= 1).all()
    assert (batch.routing_lengths() == batch.sequence_lengths() - 1).all()  # the last token never forwarded


def test_routing_equals_a_trainer_forward_with_record(bf16_engine):
    batch = bf16_engine.generate(PROMPTS, spec(seed=1))
    micro, recorded, _ = trainer_pass(bf16_engine.model, batch)
    valid = micro.routing_valid
    engine_trace = micro.routed_experts.long()[valid]
    trainer_trace = recorded.recorded_routing[valid]
    assert float(routing_agreement(engine_trace, trainer_trace)["routing_agreement"]) == 1.0


def test_processed_logprobs_equal_trainer_kept_set_logsoftmax(bf16_engine):
    batch = bf16_engine.generate(PROMPTS, spec(seed=2))
    micro, recorded, replayed = trainer_pass(bf16_engine.model, batch)
    torch.testing.assert_close(recorded.old_logp, micro.rollout_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(replayed.old_logp, micro.rollout_logp, atol=1e-5, rtol=0)
    _, plain, _ = trainer_pass(bf16_engine.model, batch, keep_sampling_mask=False, trace=False)
    assert (plain.old_logp <= micro.rollout_logp + 1e-6).all()  # full-vocab normalizer is larger
    assert (plain.old_logp < micro.rollout_logp - 1e-4).any()


def test_fp8_block128_makes_a_real_mismatch(bf16_engine):
    """Engine on fp8 weights vs trainer on the full-precision weights: routing agreement drops
    below 1 and token KL rises above the bf16 engine's (≈ 0)."""
    fp8 = make_engine("fp8_block128")
    fp8.update_weights(iter_hf_weights(bf16_engine.model), version=1)
    assert fp8.last_quant_report.num_quantized > 0 and fp8.last_quant_report.rel_err > 0.005

    def mismatch(engine):
        batch = engine.generate(PROMPTS * 2, spec(seed=3))
        micro, recorded, _ = trainer_pass(bf16_engine.model, batch, trace=False)
        log_rho = recorded.old_logp - micro.rollout_logp  # old - rollout
        kl_k3 = (log_rho.exp() - log_rho - 1).mean()
        valid = micro.routing_valid
        agree = routing_agreement(micro.routed_experts.long()[valid], recorded.recorded_routing[valid])
        return float(kl_k3), float(agree["routing_agreement"])

    kl_bf16, agree_bf16 = mismatch(bf16_engine)
    kl_fp8, agree_fp8 = mismatch(fp8)
    assert agree_bf16 == 1.0 and kl_bf16 < 1e-9
    assert agree_fp8 < 1.0
    assert kl_fp8 > kl_bf16 + 1e-7


def test_greedy_is_deterministic_and_update_changes_outputs(bf16_engine):
    greedy = SamplingSpec(temperature=0.0, max_new_tokens=5, n=1)
    a = bf16_engine.generate(PROMPTS, greedy)
    b = bf16_engine.generate(PROMPTS, greedy)
    assert torch.equal(a.response_ids, b.response_ids)
    other = make_engine("bf16")
    weights = {n: t.clone() for n, t in iter_hf_weights(bf16_engine.model)}
    weights["lm_head.weight"].zero_()
    other.update_weights(weights.items(), version=7)
    uniform = other.generate(PROMPTS, SamplingSpec(temperature=1.0, max_new_tokens=3, n=2))
    torch.testing.assert_close(
        uniform.rollout_logp,
        torch.full_like(uniform.rollout_logp, -torch.log(torch.tensor(float(VOCAB))).item()),
    )
    assert uniform.policy_version == 7 and uniform.min_policy_version() == 7
