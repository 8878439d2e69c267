"""Supervised warm start: demonstrations, and the recipe `moe-rl sft` trains on them with.

`moe-rl sft RECIPE` trains the recipe's Megatron model on demonstrations with the loss on the
response's model-written tokens only, through the offline loop: `sft_overrides` makes the recipe an
offline run of the SFT objective (``algo.objective=sft``: every demonstration of weight 1, maximum
likelihood, the token-mean negative log-likelihood in ``train/loss``). No sampling policy wrote a
demonstration, so a step reports no drift from one (``old/*``) and no stored reward. Each step
evaluates fresh rollouts of the policy as any offline run does (``reward/mean``). The run directory and checkpoints are a training run's: `moe-rl train --resume`
continues it, `moe-rl export` exports it, and an RL run starts from it with `--init-from RUN`
(`model.init_from`).

Demonstrations (`sft.demonstrations`):

* ``file:PATH``: JSONL, one demonstration a line: ``{"prompt": text, "response": text}``
  (tokenized with the recipe's tokenizer; the response ends with ``model.eos_token_id`` when the
  recipe has one), or ``{"prompt_ids": [...], "response_ids": [...]}``;
* ``env``: made by the recipe's environment (`env.name`) for `sft.num_demonstrations` prompts of
  `data.task` (drawn with a seed of their own, so the runs of the same seed evaluate and train
  on other prompts): a scripted policy (`Demonstrator`) writes each model turn an environment's
  ``demonstrate`` gives, and the environment answers as in a rollout, so a demonstration has the
  layout of a multi-turn trajectory (environment tokens not trained on).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from moe_rl.config.derived import CORRECTIONS_OFF
from moe_rl.data.trajectory import Sample, TrajectoryBatch
from moe_rl.errors import ConfigError, UserError
from moe_rl.rewards.tasks import Prompt
from moe_rl.rollout.engine import SamplingSpec

SFT_OVERRIDES = (
    "run.mode=offline",
    "algo.objective=sft",
    "algo.aggregation=token_mean",
    *CORRECTIONS_OFF,
    "algo.zero_variance_shaping=false",
    "algo.dynamic_sampling=false",
    "algo.kl.coef=0",
    "trainer.compute_entropy=false",
    "data.trajectories=null",
)
"""What `moe-rl sft` sets on a recipe (after the user's overrides): an offline run of the SFT
objective, every demonstration of weight 1, so the loss is the negative log-likelihood of the
demonstrations' model-written tokens (token mean); nothing that compares a sampling policy with the
trainer's."""


def sft_overrides(recipe, overrides: Sequence[str]) -> list[str]:
    """The overrides that make ``recipe`` (with the user's ``overrides``) the SFT run of `moe-rl
    sft`: `SFT_OVERRIDES`, and `sft.demonstrations=env` when the recipe names no demonstrations and
    has an environment to make them."""
    from moe_rl.config.loader import load_recipe

    config = load_recipe(recipe, overrides)
    extra = []
    if config.sft.demonstrations is None:
        if config.env.name is None:
            raise ConfigError(
                "sft.demonstrations is not set and the recipe has no environment (env.name) to make them: "
                "give sft.demonstrations=file:PATH (JSONL of prompt / response)"
            )
        extra.append("sft.demonstrations=env")
    return [*overrides, *SFT_OVERRIDES, *extra]


DEMONSTRATION = "demonstration"
"""The engine and weight recipe a demonstration is labelled with (no engine sampled it)."""
DEMONSTRATION_SEED_OFFSET = 104_723
"""Seed offset of the prompts demonstrations are made for: a run of the same seed (its evaluation,
an RL run started from the SFT run) draws other prompts."""


def _sample(prompt: Sequence[int], response: Sequence[int], group: int) -> Sample:
    return Sample(
        prompt_ids=torch.tensor(list(prompt), dtype=torch.int32),
        response_ids=torch.tensor(list(response), dtype=torch.int32),
        rollout_logp=torch.zeros(len(response), dtype=torch.float32),
        reward=1.0, group_id=group, finish_reason="stop", version_spans=[(0, 0)],
    )  # fmt: skip


def _batch(samples: list[Sample]) -> TrajectoryBatch:
    return TrajectoryBatch.from_samples(
        samples, engine=DEMONSTRATION, quant_recipe=DEMONSTRATION, policy_version=0
    )


class Demonstrator:
    """A rollout engine that writes demonstrations instead of sampling: each context's next turn is
    ``turn(context)``. `moe_rl.envs.rollout.MultiTurnRollout` drives it as it drives an engine."""

    policy_version = 0

    def __init__(self, turn):
        self.turn = turn

    def generate(self, contexts: Sequence[Sequence[int]], spec: SamplingSpec) -> TrajectoryBatch:
        samples = []
        for i, context in enumerate(contexts):
            tokens = list(self.turn(list(context)))[: spec.max_new_tokens]
            samples.append(_sample(context, tokens, i))
        return _batch(samples)


def build_demonstrations(config) -> TrajectoryBatch:
    """The demonstrations of `sft.demonstrations` (see the module docstring), each its own group
    (taken as a correct response: reward 1, which SFT does not read), checked against the recipe's
    lengths and vocabulary."""
    source = config.sft.demonstrations
    kind, _, path = source.partition(":")
    if source == "env":
        batch = _from_env(config)
    elif kind == "file" and path:
        batch = _from_file(config, Path(path))
    else:
        raise ConfigError(f"sft.demonstrations={source!r}: expected `file:PATH` (JSONL) or `env`")
    n = batch.num_samples
    batch = batch.replace(
        rewards=torch.ones(n, dtype=torch.float32), group_ids=torch.arange(n, dtype=torch.int64)
    )
    if n < config.rollout.batch_size:
        raise ConfigError(
            f"sft.demonstrations={source}: {n} demonstrations < rollout.batch_size={config.rollout.batch_size} "
            "(one step's batch)"
        )
    return batch


def _from_env(config) -> TrajectoryBatch:
    from moe_rl.envs.registry import build_env_factory
    from moe_rl.envs.rollout import MultiTurnRollout, TurnLimits
    from moe_rl.rewards.registry import build_prompt_source

    env = config.env
    if env.name is None:
        raise ConfigError("sft.demonstrations=env needs an environment (env.name) to make them")
    make_env = build_env_factory(env.name, dict(env.kwargs))
    demonstrate = getattr(make_env(), "demonstrate", None)
    if not callable(demonstrate):
        raise ConfigError(
            f"sft.demonstrations=env: env.name={env.name} has no `demonstrate(context)` method; give "
            "sft.demonstrations=file:PATH"
        )
    source = build_prompt_source(config)
    source.rng.seed(config.run.seed + DEMONSTRATION_SEED_OFFSET)  # not the prompts a run draws
    prompts: list[Prompt] = source.next_batch(config.sft.num_demonstrations)
    limits = TurnLimits.of(config)
    rollout = MultiTurnRollout(Demonstrator(demonstrate), make_env, limits, config.model.vocab_size, env.name)
    spec = SamplingSpec(n=1, max_new_tokens=config.rollout.max_new_tokens, temperature=1.0)
    batch, _ = rollout.generate(prompts, spec)
    return batch


def _from_file(config, path: Path) -> TrajectoryBatch:
    from moe_rl.rewards.registry import build_tokenizer

    where = f"sft.demonstrations=file:{path}"
    if not path.is_file():
        raise ConfigError(f"{where}: no such file")
    tokenizer = None
    limit, vocab, eos = config.data.max_prompt_len, config.model.vocab_size, config.model.eos_token_id
    samples = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        at = f"{path}: line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{at}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{at}: a demonstration is an object, got {type(record).__name__}")
        if "prompt_ids" in record or "response_ids" in record:
            prompt, response = (_ids(record, key, at, vocab) for key in ("prompt_ids", "response_ids"))
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
            tokenizer = tokenizer or build_tokenizer(config)
            if tokenizer is None:
                raise UserError(
                    f"{at}: text demonstrations need a tokenizer, and data.task={config.data.task} is made of "
                    "token ids (no model.hf_path tokenizer); give prompt_ids / response_ids"
                )
            prompt = tokenizer.encode(record["prompt"])
            response = tokenizer.encode(record["response"]) + ([eos] if eos is not None else [])
        else:
            raise UserError(
                f"{at}: expected text `prompt` and `response`, or `prompt_ids` and `response_ids`"
            )
        if not prompt or not response:
            raise UserError(f"{at}: the prompt and the response need a token each")
        if len(prompt) > limit:
            raise UserError(f"{at}: the prompt has {len(prompt)} tokens > data.max_prompt_len={limit}")
        budget = _response_budget(config)
        if len(response) > budget:
            raise UserError(f"{at}: the response has {len(response)} tokens > the response budget {budget}")
        samples.append(_sample(prompt, response, len(samples)))
    if not samples:
        raise ConfigError(f"{where}: the file holds no demonstration")
    return _batch(samples)


def _ids(record: dict[str, Any], key: str, at: str, vocab: int) -> list[int]:
    ids = record.get(key)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise UserError(f"{at}: `{key}` must be a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise UserError(f"{at}: `{key}` has ids outside [0, {vocab}) (model.vocab_size): {bad[:5]}")
    return ids


def _response_budget(config) -> int:
    from moe_rl.config.derived import longest_sequence

    return longest_sequence(config) - config.data.max_prompt_len
