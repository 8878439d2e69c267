"""The teacher of on-policy distillation (``algo.distill.coef`` > 0, the ``teacher:`` section).

The student samples; the teacher scores the student's own tokens. At the π_old pass each response
token gets ``coef·(log π_teacher(y_t) − log π_old(y_t))`` added to its advantage: the negative of
the per-token reverse KL from the student to the teacher, whose expectation under the student's
samples is −KL(π_student ‖ π_teacher) [Agarwal et al. 2024, arXiv:2306.13649; Qwen3's on-policy
distillation, arXiv:2505.09388]. With a task reward too, both terms add (0: the reward alone).

The teacher is a frozen Megatron model held on the trainer's ranks as the reference policy is
(`moe_rl.trainer.reference.ReferencePolicy`: eval mode, no gradients, in no optimizer, its weights
optionally in host memory between passes, ``teacher.offload``), in the trainer's parallel layout,
with its own architecture (`TeacherSource.model`: the student's vocabulary, any size) and its own
routing (no replay: the replayed routing is the student's). Its log-probs use the π_old pass's
options (temperature, keep-sampling-mask's kept sets).

`teacher_source` resolves ``teacher.path`` once, without torch (the preflight asks it before
anything loads): a run directory's newest usable checkpoint, a checkpoint folder, or a Hugging Face
folder, and the teacher's architecture from ``teacher.model_recipe`` or the teacher run's own
``config.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_rl.config.schema import ModelConfig, RecipeConfig
from moe_rl.errors import UserError, brief

RUN_CONFIG = "config.yaml"
"""The recipe a run directory keeps (`moe_rl.run_dir`)."""


@dataclass(frozen=True)
class TeacherSource:
    """Where the teacher's weights are and what model holds them."""

    model: ModelConfig
    weights: Path
    """A trainer checkpoint (``<checkpoint>/trainer``) or a Hugging Face folder."""
    hf: bool
    """``weights`` is a Hugging Face folder."""


def teacher_source(config: RecipeConfig) -> TeacherSource:
    """``teacher.path`` resolved (see the module docstring); one `UserError` naming the key when it
    is none of the three forms, has no usable checkpoint, or holds a model of another vocabulary."""
    from moe_rl.config.loader import load_recipe
    from moe_rl.run_dir import init_checkpoint

    t = config.teacher
    path = Path(t.path)
    key = f"teacher.path={brief(t.path)}"
    hf = (path / "config.json").is_file()
    if hf:
        if t.model_recipe is None:
            raise UserError(
                f"{key} is a Hugging Face folder: set teacher.model_recipe to a recipe whose model: section is "
                "the teacher's architecture"
            )
        weights = path
    else:
        weights = init_checkpoint(path, key=key)
    recipe = Path(t.model_recipe) if t.model_recipe else weights.parent.parent.parent / RUN_CONFIG
    if not recipe.is_file():
        raise UserError(
            f"{key}: the teacher's architecture is read from {recipe}, which is not there; set teacher.model_recipe"
        )
    model = load_recipe(recipe).model
    if model.vocab_size != config.model.vocab_size:
        raise UserError(
            f"{key}: the teacher's vocabulary has {model.vocab_size} ids, the student's (model.vocab_size) "
            f"{config.model.vocab_size}: a teacher scores the student's tokens, so both need the same tokenizer"
        )
    return TeacherSource(model, weights, hf)


def build_teacher(config: RecipeConfig, source: TeacherSource, device):
    """The frozen teacher of this trainer rank: ``source.model`` in the trainer's layout with the
    weights of ``source``, held as a `ReferencePolicy` without replay."""
    from moe_rl.megatron.hf_weights import load_hf_checkpoint
    from moe_rl.megatron.model import build_gpt_model
    from moe_rl.trainer.checkpoint import builder, load_model_weights
    from moe_rl.trainer.reference import ReferencePolicy

    model = build_gpt_model(source.model, config.parallel, config.trainer, seed=config.run.seed)
    if source.hf:
        load_hf_checkpoint(model, source.weights)
    else:
        whose = f"teacher.path={brief(config.teacher.path)}"
        load_model_weights(model, source.weights, whose, start=builder(source.model, config))
    return ReferencePolicy(model, device, offload=config.teacher.offload, replay=False)
