"""`data.reward` → a scorer of (prompt, response ids) in one place."""

from __future__ import annotations

from collections.abc import Sequence

from moe_rl.rewards.datasets import Tokenizer
from moe_rl.rewards.functions import exact_match, load_user_function, math_answer
from moe_rl.rewards.tasks import EOS, Prompt, SyntheticTask

TEXT_REWARDS = {"exact_match": exact_match, "math": math_answer}


class RewardScorer:
    """Scores responses: the synthetic task's own checker, or a text reward on decoded responses."""

    def __init__(self, reward: str, task: SyntheticTask | None = None, tokenizer: Tokenizer | None = None):
        self.task = task
        self.tokenizer = tokenizer
        if reward == "synthetic":
            if task is None:
                raise ValueError("data.reward=synthetic needs data.task=synthetic:<task>")
            self.text_fn = None
        else:
            self.text_fn = TEXT_REWARDS.get(reward) or load_user_function(reward)
            if tokenizer is None:
                raise ValueError(f"data.reward={reward} scores text: the model needs a tokenizer")

    def score(self, prompt: Prompt, response: Sequence[int]) -> float:
        if self.text_fn is None:
            return float(self.task.score(prompt, response))
        body = list(response)
        if EOS in body:
            body = body[: body.index(EOS)]
        value = float(self.text_fn(self.tokenizer.decode(body), str(prompt.answer)))
        if value != value:  # NaN
            raise ValueError(f"reward function returned NaN for answer {prompt.answer!r}")
        return value

    def score_all(self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        return [self.score(p, r) for p, r in zip(prompts, responses)]
