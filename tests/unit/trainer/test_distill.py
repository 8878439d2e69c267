"""On-policy distillation in the trainer: a teacher of another size, read from a run directory, scores
the student's tokens by its own routing; each token's advantage gains coef·(teacher − π_old) less the
batch's mean of it; a
teacher of another vocabulary, or a run without a usable checkpoint, is one line naming the key."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_testing import micro_batches, one_response, tiny_recipe

from moe_rl.config.loader import to_yaml
from moe_rl.errors import UserError
from moe_rl.run_dir import write_manifest
from moe_rl.trainer.teacher import teacher_source
from moe_rl.trainer.worker import TrainerWorker

WIDER = ("model.hidden_size=48", "algo.routing_replay=off", "run.seed=5")
"""The teacher: the tiny model half again as wide, its own weights."""


def _teacher_run(tmp_path, *overrides: str):
    """A run directory holding one sealed checkpoint of a worker built from ``overrides``, and the
    worker."""
    config = tiny_recipe(*overrides)
    worker = TrainerWorker(config)
    run = tmp_path / "teacher"
    checkpoint = run / "checkpoints" / "step_000000"
    worker.save_checkpoint(checkpoint / "trainer")
    write_manifest(checkpoint)
    (run / "config.yaml").write_text(to_yaml(config))
    return run, worker


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return _teacher_run(tmp_path_factory.mktemp("distill"), *WIDER)


def test_the_teacher_scores_the_students_tokens(teacher):
    run, teacher_worker = teacher
    student = TrainerWorker(tiny_recipe("algo.distill.coef=0.5", f"teacher.path={run}"))
    assert student.teacher.model.config.hidden_size == 48 and student.teacher.replay is None
    mbs = micro_batches(0, 12, student.config.model, max_tokens=48)
    prepared, metrics = student.compute_old_logp(mbs)
    # the teacher's log-probs are what the teacher itself computes at its own π_old pass
    expected, _ = teacher_worker.compute_old_logp(mbs)
    reverse_kl = torch.cat([mb.old_logp - mb.teacher_logp for mb in prepared]).double().mean()
    assert metrics["distill/reverse_kl"] == pytest.approx(float(reverse_kl), rel=1e-9)
    assert abs(float(reverse_kl)) > 1e-3  # the baseline below is not zero
    for mb, own, given in zip(prepared, expected, mbs, strict=True):
        assert torch.equal(mb.teacher_logp, own.old_logp)
        gap = own.old_logp - mb.old_logp
        assert gap.abs().sum() > 0
        # each token's log-ratio less the batch's mean of it (every micro-batch's tokens)
        torch.testing.assert_close(mb.advantages, given.advantages + 0.5 * (gap + reverse_kl.float()))
    assert metrics["distill/teacher_s"] > 0
    out = student.train_step(prepared)
    assert out["train/update_ok"] == 1.0
    # a batch of one token: its gap is the whole mean, and its advantage is the driver's alone
    for seed in range(200):  # one that the teacher and student score apart (a kept set of one: both 0)
        (mb,) = micro_batches(seed, 1, student.config.model)
        if mb.micro.response_positions.numel() == 1:
            (one,), metrics = student.compute_old_logp([mb])
            if float(one.old_logp - one.teacher_logp) != 0:
                break
    else:
        raise AssertionError("no one-token response that the teacher and the student score apart")
    assert metrics["distill/reverse_kl"] == pytest.approx(float(one.old_logp - one.teacher_logp), rel=1e-6)
    torch.testing.assert_close(one.advantages, mb.advantages)
    _, metrics = student.compute_old_logp(one_response(student.config.model, 0))  # no token at all
    assert metrics["distill/reverse_kl"] == 0.0
    source = teacher_source(student.config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.hf = True


def test_a_teacher_of_another_vocabulary_is_refused(tmp_path):
    run, _ = _teacher_run(tmp_path, "model.vocab_size=96", "algo.routing_replay=off")
    with pytest.raises(UserError, match=r"teacher.path=.*vocabulary has 96 ids.*same tokenizer"):
        TrainerWorker(tiny_recipe("algo.distill.coef=0.5", f"teacher.path={run}"))


def test_a_teacher_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"teacher.path=.*neither a run directory"):
        TrainerWorker(tiny_recipe("algo.distill.coef=0.5", f"teacher.path={tmp_path}"))
