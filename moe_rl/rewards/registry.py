"""`data.reward` → a scorer of (prompt, response ids) in one place."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from pathlib import Path

from moe_rl.errors import ConfigError, RewardFunctionError, UserError
from moe_rl.rewards.datasets import ByteTokenizer, ChatFormat, HFTokenizer, PromptSource, Tokenizer
from moe_rl.rewards.functions import exact_match, load_user_function, math_answer
from moe_rl.rewards.tasks import Prompt, SyntheticTask, check_task_vocab, get_task
from moe_rl.rules import Rule

TEXT_REWARDS = {"exact_match": exact_match, "math": math_answer}


class RewardScorer:
    """Scores responses: the synthetic task's own checker, or a text reward on decoded responses."""

    def __init__(self, reward: str, task: SyntheticTask | None = None, tokenizer: Tokenizer | None = None):
        self.task, self.tokenizer, self.reward = task, tokenizer, reward
        if reward == "synthetic":
            if task is None:
                raise ConfigError("data.reward=synthetic needs data.task=synthetic:<task>")
            self.text_fn = None
        else:
            self.text_fn = TEXT_REWARDS.get(reward) or load_user_function(reward)
            if tokenizer is None:
                raise ConfigError(f"data.reward={reward} scores text: the model needs a tokenizer")

    def score(self, prompt: Prompt, response: Sequence[int]) -> float:
        if self.text_fn is None:
            return float(self.task.score(prompt, response))
        text = self.tokenizer.decode_response(response)
        try:
            value = self.text_fn(text, str(prompt.answer))
        except Exception as exc:  # the user's code: any failure is reported as theirs, with the input
            raise RewardFunctionError(
                f"reward function data.reward={self.reward} raised {type(exc).__name__}: {exc} "
                f"(response {text[:80]!r}, answer {prompt.answer!r})"
            ) from exc
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardFunctionError(
                f"reward function data.reward={self.reward} returned {value!r} ({type(value).__name__}) for "
                f"answer {prompt.answer!r}; it must return a finite number"
            )
        return float(value)

    def score_all(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return [self.score(p, r) for p, r in zip(prompts, responses)]


def build_tokenizer(config) -> Tokenizer | None:
    """The model's own tokenizer (a local HF folder), a byte tokenizer for text data on a model
    without one, or None for synthetic tasks (their prompts are token ids)."""
    if config.model.hf_path and (Path(config.model.hf_path) / "tokenizer_config.json").exists():
        return HFTokenizer(config.model.hf_path, eos_token_id=config.model.eos_token_id)
    if config.data.task.startswith("synthetic:"):
        return None
    tokenizer = ByteTokenizer()
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"data.task={config.data.task} on a model without a tokenizer uses bytes (vocabulary "
            f"{tokenizer.vocab_size}); model.vocab_size={config.model.vocab_size} is too small"
        )
    return tokenizer


def reward_rules(config) -> list[Rule]:
    """The rewards' rules on a recipe, checked before anything loads: a synthetic task
    (``data.task=synthetic:<name>``) exists and fits the model's vocabulary. What needs the data
    or the reward function itself is checked when they are built (`moe_rl.orchestration.preflight`,
    the run's inputs)."""
    kind, _, name = config.data.task.partition(":")
    if kind != "synthetic":
        return []
    try:
        check_task_vocab(name, config.model.vocab_size)  # an unknown task is named there too
    except UserError as exc:
        return [Rule("synthetic task", False, str(exc))]
    return [Rule("synthetic task", True, f"{name} fits model.vocab_size={config.model.vocab_size}")]


def build_scorer(config) -> RewardScorer:
    """The scorer of `data.reward` for `data.task` (config meets rewards here)."""
    kind, _, name = config.data.task.partition(":")
    task = get_task(name) if kind == "synthetic" else None
    return RewardScorer(config.data.reward, task=task, tokenizer=build_tokenizer(config))


def build_prompt_source(config) -> PromptSource:
    """The seeded prompt stream of `data.task`, formatted by the `data.*` template keys."""
    d = config.data
    return PromptSource(
        d.task,
        seed=config.run.seed,
        tokenizer=build_tokenizer(config),
        prompt_key=d.prompt_key,
        answer_key=d.answer_key,
        max_prompt_len=d.max_prompt_len,
        prompt_template=d.prompt_template,
        chat=ChatFormat(d.system_prompt, dict(d.chat_template_kwargs)) if d.chat_template else None,
    )
